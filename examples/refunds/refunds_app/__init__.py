"""An Outbox app of its own: refunds and customer messages, served by the stock processes."""
