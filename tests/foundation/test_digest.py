from __future__ import annotations

from outbox.creating import digest


def test_key_order_and_whitespace_do_not_matter():
    a = digest.args_digest("t", 1, {"a": 1, "b": {"y": 2, "x": [1, 2]}})
    b = digest.args_digest("t", 1, {"b": {"x": [1, 2], "y": 2}, "a": 1})
    assert a == b and len(a) == 64


def test_tool_name_and_payload_version_matter():
    base = digest.args_digest("t", 1, {"a": 1})
    assert digest.args_digest("u", 1, {"a": 1}) != base
    assert digest.args_digest("t", 2, {"a": 1}) != base


def test_values_list_order_and_unicode_form_matter():
    assert digest.args_digest("t", 1, {"a": [1, 2]}) != digest.args_digest("t", 1, {"a": [2, 1]})
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    assert digest.args_digest("t", 1, {"a": nfc}) != digest.args_digest("t", 1, {"a": nfd})


def test_canonical_json_is_compact_sorted_utf8():
    assert digest.canonical_json({"b": "é", "a": 1}) == '{"a":1,"b":"é"}'.encode()


def test_digest_is_stable_across_releases():
    # A changed digest would turn every retry after an upgrade into a conflict. The value is
    # sha256 of '{"arguments":{"subject":"x"},"payload_version":1,"tool":"create_support_task"}'.
    assert (
        digest.args_digest("create_support_task", 1, {"subject": "x"})
        == "c1776d27cab7ab4928b38e2fbc770baef37efef80ee057c8be0a985b8161a3ef"
    )
