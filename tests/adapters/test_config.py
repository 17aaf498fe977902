"""load_registry: the TOML file, the environment variable, the built-in default."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import respx

from adapters import ADAPTERS_ENV, ConfigError, HttpAdapter, Outcome, load_registry
from adapters.config import all_keys as config_keys
from adapters.testing import NoopAdapter
from tests.adapters.support import request_for

EXAMPLE = Path(__file__).resolve().parents[2] / "adapters" / "example.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "adapters.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_default_is_one_helpdesk_adapter_on_loopback() -> None:
    with load_registry(env={}) as registry:
        assert registry.names() == ("helpdesk",)
        adapter = registry.get("helpdesk")
        assert isinstance(adapter, HttpAdapter)
        assert adapter.config.url == "http://127.0.0.1:9000/v1/tickets"
        assert adapter.config.lookup_url == (
            "http://127.0.0.1:9000/v1/tickets?client_reference={effect_key}"
        )
        assert adapter.capabilities.honours_idempotency_keys
        assert adapter.capabilities.supports_lookup


def test_the_path_comes_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[adapters.bench]\nkind = "noop"\n')
    with load_registry(env={ADAPTERS_ENV: str(path)}) as registry:
        assert registry.names() == ("bench",)
        assert isinstance(registry.get("bench"), NoopAdapter)


def test_an_explicit_path_wins_over_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[adapters.mine]\nkind = "noop"\n')
    with load_registry(path, env={ADAPTERS_ENV: "/nonexistent.toml"}) as registry:
        assert "mine" in registry


def test_the_example_file_loads_and_is_documented() -> None:
    env = {
        "CRM_TOKEN": "t",
        "NOTES_CLIENT_ID": "id",
        "NOTES_CLIENT_SECRET": "secret",
        "STRIPE_API_KEY": "sk_test_x",
    }
    with load_registry(EXAMPLE, env=env) as registry:
        assert set(registry.names()) >= {"helpdesk", "crm", "notes", "payments"}
        notes = registry.get("notes")
        assert isinstance(notes, HttpAdapter)
        assert notes.capabilities.key_retention_seconds == 24 * 3600
    docs = (EXAMPLE.parents[1] / "docs" / "adapters.md").read_text(encoding="utf-8")
    for key in sorted(config_keys()):
        assert f"`{key}`" in docs, f"docs/adapters.md does not describe {key}"
    with load_registry(EXAMPLE, env=env) as registry:
        crm = registry.get("crm")
        assert isinstance(crm, HttpAdapter)
        assert not crm.capabilities.honours_idempotency_keys


def test_a_full_http_adapter_from_toml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[adapters.crm]
kind = "http"
url = "https://crm.example.test/v1/notes"
method = "PUT"
headers = { "X-Team" = "blue" }
auth_env = "CRM_TOKEN"
idempotency_header = "X-Request-Key"
client_reference_field = false
reference_field = "note.id"
lookup_url = "https://crm.example.test/v1/notes/{reference}"
lookup_list_field = false
connect_timeout = 1
read_timeout = 4.5
total_timeout = 6
max_connections = 8
honours_idempotency_keys = false
supports_lookup = true
lookup_settle_seconds = 2
""",
    )
    router = respx.Router()
    route = router.put("https://crm.example.test/v1/notes").respond(
        200, json={"note": {"id": "N-1"}}
    )
    transport = httpx.MockTransport(router.handler)
    with load_registry(path, env={"CRM_TOKEN": "tok"}, transport=transport) as registry:
        crm = registry.get("crm")
        assert isinstance(crm, HttpAdapter)
        config = crm.config
        assert (config.method, config.idempotency_header, config.reference_field) == (
            "PUT",
            "X-Request-Key",
            "note.id",
        )
        assert config.client_reference_field is None and config.lookup_list_field is None
        assert (config.connect_timeout, config.read_timeout, config.total_timeout) == (1, 4.5, 6)
        assert config.max_connections == 8
        assert crm.capabilities.lookup_settle_seconds == 2.0
        result = crm.deliver(request_for("k-1"))
        assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "N-1")
        sent = route.calls.last.request
        assert sent.headers["Authorization"] == "Bearer tok"
        assert sent.headers["X-Request-Key"] == "k-1"
        assert sent.headers["X-Team"] == "blue"


def test_helpdesk_kind_with_a_base_url_and_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[adapters.helpdesk]
kind = "helpdesk"
base_url = "http://127.0.0.1:9100/"
honours_idempotency_keys = false
supports_lookup = false
read_timeout = 3
""",
    )
    with load_registry(path, env={}) as registry:
        adapter = registry.get("helpdesk")
        assert isinstance(adapter, HttpAdapter)
        assert adapter.config.url == "http://127.0.0.1:9100/v1/tickets"
        assert adapter.config.read_timeout == 3.0
        assert not adapter.capabilities.honours_idempotency_keys
        assert not adapter.capabilities.supports_lookup


def test_http_kind_infers_lookup_support_from_lookup_url(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[adapters.a]
kind = "http"
url = "http://a.test/x"
honours_idempotency_keys = true
lookup_url = "http://a.test/x?k={effect_key}"

[adapters.b]
kind = "http"
url = "http://b.test/x"
honours_idempotency_keys = true
""",
    )
    with load_registry(path, env={}) as registry:
        assert registry.get("a").capabilities.supports_lookup
        assert not registry.get("b").capabilities.supports_lookup


MINIMAL = 'kind = "http"\nurl = "http://a.test/x"\nhonours_idempotency_keys = true\n'


@pytest.mark.parametrize(
    ("body", "field", "hint"),
    [
        ('kind = "http"\nhonours_idempotency_keys = true\n', "url", "set url"),
        ('kind = "http"\nurl = "http://a.test/x"\n', "honours_idempotency_keys", "honours"),
        ('url = "http://a.test/x"\n', "kind", "set kind"),
        ('kind = "smtp"\n', "kind", "http, helpdesk, noop"),
        (MINIMAL + "read_timout = 3\n", "read_timout", "did you mean 'read_timeout'"),
        (MINIMAL + "colour = 3\n", "colour", "not a setting"),
        (MINIMAL + 'read_timeout = "10"\n', "read_timeout", "number of seconds"),
        (MINIMAL + "read_timeout = 0\n", "read_timeout", "> 0"),
        (MINIMAL + "lookup_settle_seconds = -1\n", "lookup_settle_seconds", ">= 0"),
        (MINIMAL + "max_connections = 2.5\n", "max_connections", "whole number"),
        (MINIMAL + "max_connections = 0\n", "max_connections", "whole number"),
        (MINIMAL + "supports_lookup = 1\n", "supports_lookup", "true or false"),
        (MINIMAL + "supports_lookup = true\n", "supports_lookup", "lookup_url"),
        (MINIMAL + "headers = 3\n", "headers", "table"),
        (MINIMAL + "idempotency_header = true\n", "idempotency_header", "false to switch"),
        (MINIMAL.replace("http://a", "ftp://a"), "url", "http:// or https://"),
        (MINIMAL.replace("http://a.test/x", "a.test/x"), "url", "http:// or https://"),
        (MINIMAL + 'auth_env = "NOT_SET_ANYWHERE"\n', "auth_env", "NOT_SET_ANYWHERE"),
        ('kind = "noop"\nurl = "http://a.test"\n', "url", "not a setting of a 'noop'"),
    ],
)
def test_bad_config_names_the_adapter_the_field_and_the_fix(
    tmp_path: Path, body: str, field: str, hint: str
) -> None:
    path = write(tmp_path, f"[adapters.crm]\n{body}")
    with pytest.raises(ConfigError) as info:
        load_registry(path, env={})
    assert (info.value.adapter, info.value.field) == ("crm", field)
    message = str(info.value)
    assert f"crm.{field}" in message, message
    assert hint in message, message


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("", "no adapters configured"),
        ("[adapters]\n", "no adapters configured"),
        ("adapter = 1\n", "unknown top-level key 'adapter'"),
        ("[adapters\n", "not valid TOML"),
        ("[adapters]\ncrm = 3\n", "must be a table"),
        ('[adapters."bad name"]\nkind = "noop"\n', "not a usable adapter name"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        load_registry(write(tmp_path, text), env={})


def test_a_missing_file_names_the_path_and_the_variable(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_registry(env={ADAPTERS_ENV: str(missing)})
    assert str(missing) in str(info.value) and ADAPTERS_ENV in str(info.value)


def test_a_failure_closes_the_adapters_already_built(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[adapters.good]\nkind = "helpdesk"\n\n[adapters.bad]\nkind = "helpdesk"\nbogus = 1\n',
    )
    built: list[HttpAdapter] = []
    original = HttpAdapter.__init__

    def spy(self: HttpAdapter, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HttpAdapter, "__init__", spy)
        with pytest.raises(ConfigError, match="bogus"):
            load_registry(path, env={})
    assert [adapter.name for adapter in built] == ["good"]
    assert built[0]._client.is_closed
