"""The MCP surface: every tool of the app for agent hosts, over stdio and streamable HTTP."""
