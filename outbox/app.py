"""The app: one deployment's tools, adapters, and (optionally) its own tables.

    from outbox.app import App
    app = App(
        "refunds",
        tools=[ISSUE_REFUND, NOTIFY_CUSTOMER],
        adapters_file="adapters.toml",      # relative to this module's folder
        metadata=tables.metadata,           # the app's own SQLAlchemy tables
        migrations="migrations",            # their alembic versions folder
    )

Every process and command loads it the same way: ``load_app(spec)``, where
``spec`` is ``package.module:attribute`` from ``--app`` or ``OUTBOX_APP``;
without one, the bundled demo app (``create_support_task`` and the helpdesk
adapter). Loading checks everything it can before anything is written: the
module imports, the attribute is an ``App`` (or a function returning one),
every tool's arguments model becomes a JSON schema, the migrations folder
exists, the adapters file reads, and every adapter a tool declares is
configured. Each failure is one ``AppError`` naming what to fix.

Adapters. The app's file (``adapters_file``) and/or a function returning an
``adapters.Registry`` (``adapters_factory``): both may be given, and their
adapters are merged (a name twice is an error). ``OUTBOX_ADAPTERS`` (or an
explicit path) replaces the app's file for one deployment, e.g. to point the
same adapters at other hosts; the factory's adapters are kept.

The app's own migrations run after Outbox's, with their own alembic version
table (``alembic_version_<name>``), so the two histories never mix.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

import adapters
from outbox import errors, tools

APP_ENV = "OUTBOX_APP"
"""Environment variable naming the app: ``package.module:attribute``."""

DEFAULT_APP_NAME = "demo"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_MIGRATIONS_LOCK = 726374  # PostgreSQL advisory lock: one migrator of an app at a time

AdaptersFactory = Callable[[], adapters.Registry]


class AppError(errors.ConfigError):
    """The app cannot be loaded or is inconsistent."""

    problem_type = "app"
    title = "Invalid app"


class AppSchemaNotCurrent(errors.SchemaError):
    """The app's own tables are behind its migrations: run `outbox db upgrade`."""

    def __init__(self, app: str, current: str | None, head: str) -> None:
        self.app, self.current, self.head = app, current, head
        at = f"at revision {current}" if current else "not migrated"
        super().__init__(
            f"the tables of app {app!r} are {at}, its migrations need {head}: "
            "run `outbox db upgrade` first"
        )


class App:
    """A deployment's tools and adapters, and optionally its own tables and migrations.

    ``tools``: an ``outbox.tools.Registry`` or an iterable of ``Tool``.
    ``adapters_file``: a declarative adapters TOML file; a relative path is
    resolved against ``root`` (default: the folder of the module that builds
    the ``App``). ``adapters_factory``: a function returning an
    ``adapters.Registry``, for adapters written in Python. Neither: the
    default of ``adapters.load_registry`` (``OUTBOX_ADAPTERS``, else one
    ``helpdesk`` adapter). ``metadata``: the SQLAlchemy ``MetaData`` of the
    app's own tables. ``migrations``: the alembic versions folder that
    creates them (resolved like ``adapters_file``).
    """

    def __init__(
        self,
        name: str,
        *,
        tools: tools.Registry | Iterable[tools.Tool],
        adapters_file: str | os.PathLike[str] | None = None,
        adapters_factory: AdaptersFactory | None = None,
        metadata: sa.MetaData | None = None,
        migrations: str | os.PathLike[str] | None = None,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise AppError(
                f"app name {name!r}: use 1-48 lowercase letters, digits and '_', "
                "starting with a letter (it names the app's alembic version table)"
            )
        self.name = name
        self.tools = _registry(tools)
        self.root = Path(root) if root is not None else _caller_folder()
        self.adapters_file = self._resolve(adapters_file)
        self.adapters_factory = adapters_factory
        self.metadata = metadata
        self.migrations = self._resolve(migrations)

    def _resolve(self, path: str | os.PathLike[str] | None) -> Path | None:
        if path is None:
            return None
        candidate = Path(path)
        return candidate if candidate.is_absolute() else self.root / candidate

    def __repr__(self) -> str:
        return f"App({self.name!r}, tools={self.tools.names()!r})"

    @property
    def version_table(self) -> str:
        """The alembic version table of the app's own migrations."""
        return f"alembic_version_{self.name}"

    # --- adapters ------------------------------------------------------------------

    def build_adapters(
        self, path: str | os.PathLike[str] | None = None, **options: Any
    ) -> adapters.Registry:
        """The adapter registry the dispatcher and reconciler deliver through.

        ``path`` (``OUTBOX_ADAPTERS``, from the settings) replaces the app's
        file; ``options`` go to ``adapters.load_registry`` (``env``,
        ``transport``). The caller closes the registry.
        """
        file = path if path is not None else self.adapters_file
        registry: adapters.Registry | None = None
        try:
            if file is not None or self.adapters_factory is None:
                registry = adapters.load_registry(file, **options)
            if self.adapters_factory is not None:
                extra = self.adapters_factory()
                if not isinstance(extra, adapters.Registry):
                    raise AppError(
                        f"app {self.name!r}: adapters_factory returned "
                        f"{type(extra).__name__}, not an adapters.Registry"
                    )
                if registry is None:
                    registry = extra
                else:
                    for adapter in extra:
                        registry.register(adapter)
        except adapters.AdapterError as exc:
            if registry is not None:
                registry.close()
            raise AppError(f"app {self.name!r}: adapters: {_one_line(exc)}") from exc
        except BaseException:
            if registry is not None:
                registry.close()
            raise
        assert registry is not None  # a file, the default, or the factory's
        return registry

    # --- checks ----------------------------------------------------------------------

    def check(
        self, adapters_path: str | os.PathLike[str] | None = None, *, adapters: bool = True
    ) -> None:
        """Everything that can be checked before anything runs; ``AppError`` on the first fault."""
        for name in self.tools.names():
            tool = self.tools.get(name)
            try:
                tool_schema(tool)
            except Exception as exc:  # noqa: BLE001 - pydantic raises several kinds here
                raise AppError(
                    f"app {self.name!r}: tool {name!r}: its arguments model "
                    f"{tool.arguments.__name__} cannot be turned into a JSON schema: "
                    f"{_one_line(exc)}"
                ) from None
        if self.migrations is not None and not self.migrations.is_dir():
            raise AppError(
                f"app {self.name!r}: the migrations folder {str(self.migrations)!r} does not exist"
            )
        if self.migrations is not None and self.metadata is None:
            raise AppError(
                f"app {self.name!r}: migrations need the tables' metadata (App(metadata=...))"
            )
        if not adapters:
            return  # a command that never reaches a provider needs none of its secrets
        registry = self.build_adapters(adapters_path)
        try:
            known = set(registry.names())
        finally:
            registry.close()
        for name in self.tools.names():
            missing = [a for a in self.tools.get(name).adapters if a not in known]
            if missing:
                raise AppError(
                    f"app {self.name!r}: tool {name!r} uses adapter {missing[0]!r}, which is not "
                    f"configured (adapters: {', '.join(sorted(known)) or 'none'})"
                )

    # --- the app's own migrations ---------------------------------------------------

    def head_revision(self) -> str | None:
        if self.migrations is None:
            return None
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(self._alembic_config()).get_current_head()

    def current_revision(self, engine: Engine) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": self.version_table})
            rev: str | None = context.get_current_revision()
            return rev

    def upgrade(self, engine: Engine) -> tuple[str | None, str | None]:
        """Apply the app's migrations (after Outbox's); safe to run twice, or at once."""
        if self.migrations is None:
            return None, None
        from alembic import command

        before = self.current_revision(engine)
        with engine.connect() as conn:
            postgres = conn.dialect.name == "postgresql"
            if postgres:
                conn.exec_driver_sql(f"SELECT pg_advisory_lock({_MIGRATIONS_LOCK})")
                conn.commit()
            try:
                command.upgrade(self._alembic_config(conn), "head")
                conn.commit()
            finally:
                if postgres:
                    conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_MIGRATIONS_LOCK})")
                    conn.commit()
        return before, self.current_revision(engine)

    def check_schema(self, engine: Engine) -> None:
        """Refuse to run when the app's own tables are behind its migrations."""
        head = self.head_revision()
        if head is None:
            return
        current = self.current_revision(engine)
        if current != head:
            raise AppSchemaNotCurrent(self.name, current, head)

    def _alembic_config(self, connection: Any = None) -> Any:
        from alembic.config import Config

        cfg = Config()
        # Outbox's env.py runs them, on the app's own version table and metadata.
        cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
        # One folder: split on os.pathsep (never on the spaces a path may hold).
        cfg.set_main_option("path_separator", "os")
        cfg.set_main_option("version_locations", str(self.migrations))
        cfg.attributes["version_table"] = self.version_table
        cfg.attributes["target_metadata"] = self.metadata
        if connection is not None:
            cfg.attributes["connection"] = connection
        return cfg


def tool_schema(tool: tools.Tool, ref_template: str = "#/$defs/{model}") -> dict[str, Any]:
    """The JSON schema of a tool's arguments (``ref_template`` places nested models)."""
    schema: dict[str, Any] = tool.arguments.model_json_schema(ref_template=ref_template)
    return schema


def tool_example(tool: tools.Tool) -> Any:
    """The first example the arguments model gives (``json_schema_extra={"examples": [...]}``)."""
    examples = tool_schema(tool).get("examples")
    if isinstance(examples, list) and examples:
        return examples[0]
    return None


def default_app() -> App:
    """The bundled demo: ``create_support_task`` and the helpdesk adapter defaults."""
    return App(DEFAULT_APP_NAME, tools=tools.default_registry(), root=Path.cwd())


def load_app(
    spec: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    check_adapters: bool = True,
    adapters_path: str | os.PathLike[str] | None = None,
) -> App:
    """The app named by ``spec`` (else ``$OUTBOX_APP``, else the demo), checked.

    ``adapters_path`` is the deployment's ``OUTBOX_ADAPTERS`` (it replaces the
    app's file in the check, as it will when the processes run).
    """
    environ = os.environ if env is None else env
    source = "--app" if spec else APP_ENV
    spec = spec or environ.get(APP_ENV) or None
    app = default_app() if spec is None else _import(spec.strip(), source)
    if check:
        if adapters_path is None:
            adapters_path = environ.get(adapters.ADAPTERS_ENV) or None
        app.check(adapters_path, adapters=check_adapters)
    return app


def _import(spec: str, source: str) -> App:
    where = f"{source}={spec!r}"
    if not _SPEC.match(spec):
        raise AppError(f"{where}: expected package.module:attribute, e.g. my_app.app:app")
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise AppError(
                f"{where}: cannot import {module_name!r}: no module named {exc.name!r} "
                "(is it installed, or on PYTHONPATH?)"
            ) from None
        raise AppError(
            f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    except AppError as exc:
        raise AppError(f"{where}: {exc.detail}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything
        raise AppError(
            f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    value: Any = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise AppError(
                f"{where}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not isinstance(value, App) and callable(value):
        try:
            value = value()
        except AppError as exc:
            raise AppError(f"{where}: {exc.detail}") from None
        except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
            raise AppError(
                f"{where}: calling {attribute}() failed: {type(exc).__name__}: {_one_line(exc)}"
            ) from None
    if not isinstance(value, App):
        raise AppError(f"{where}: {attribute!r} is a {type(value).__name__}, not an outbox App")
    return value


# Commands that never build adapters: a broken or secret-less adapters file must not
# stop a migration or a token being made (the processes that deliver still refuse it).
NO_ADAPTER_COMMANDS = frozenset({"db", "tenants", "tokens"})


def from_args(args: Any) -> App:
    """The app a parsed command line names (loaded once; ``main`` loads it up front)."""
    app = getattr(args, "loaded_app", None)
    if isinstance(app, App):
        return app
    app = load_app(
        getattr(args, "app", None),
        check_adapters=getattr(args, "command", None) not in NO_ADAPTER_COMMANDS,
    )
    args.loaded_app = app
    return app


def _registry(value: tools.Registry | Iterable[tools.Tool]) -> tools.Registry:
    if isinstance(value, tools.Registry):
        return value
    registry = tools.Registry()
    for tool in value:
        if not isinstance(tool, tools.Tool):
            raise AppError(f"{tool!r} is not an outbox.tools.Tool")
        try:
            registry.register(tool)
        except ValueError as exc:
            raise AppError(str(exc)) from None
    return registry


def _caller_folder() -> Path:
    # The module that called App(...): relative paths in it mean "next to me".
    frame = sys._getframe(2)
    file = frame.f_globals.get("__file__")
    return Path(file).resolve().parent if file else Path.cwd()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
