"""The daemon's settings from one declaration (policyd/daemon/settings.py): the settings file
(TOML or JSON) and its errors, the precedence defaults < file < environment < flags, the flags of
``policyd serve`` generated from the fields, extreme values refused naming the setting, and the
tunables' schema that the API documents and the dashboard's form is built from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policyd.cli import build_parser
from policyd.cli.daemon import serve_parser
from policyd.daemon.settings import (
    DaemonSettings,
    Tunables,
    TunablesChange,
    tunables,
    tunables_schema,
    validate_tunables,
)
from ui.settings_form import form_fields

# the flags `policyd serve` had before they were generated: scripts and docs use them
FLAGS_BEFORE = (
    "--db", "--events", "--snapshots", "--http-host", "--http-port", "--policy", "--token-file",
    "--token", "--allow-open-http", "--profile", "--gpu-blocks", "--vllm-events", "--vllm-replay",
    "--vllm-topic", "--checkpoint-dir", "--checkpoint-interval-s", "--log-level",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("POLICYD_CONFIG", "POLICYD_HTTP_PORT", "POLICYD_POLICY", "POLICYD_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_is_defaults_then_file_then_environment_then_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(
        tmp_path / "policyd.toml",
        'http_port = 9001\npolicy = "lru"\nidle_timeout_s = 60\nvllm_topic = "kv"\n',
    )
    settings = DaemonSettings.load({"config": config})
    assert (settings.http_port, settings.policy, settings.idle_timeout_s) == (9001, "lru", 60.0)
    assert settings.vllm_topic == "kv" and settings.tick_interval_s == 1.0  # a default kept
    monkeypatch.setenv("POLICYD_HTTP_PORT", "9002")
    settings = DaemonSettings.load({"config": config})
    assert (settings.http_port, settings.policy) == (9002, "lru")  # the environment over the file
    settings = DaemonSettings.load({"config": config, "http_port": 9003, "policy": None})
    assert (settings.http_port, settings.policy) == (9003, "lru")  # a flag over both; None: unset
    monkeypatch.setenv("POLICYD_CONFIG", str(config))  # the file named by the environment
    monkeypatch.delenv("POLICYD_HTTP_PORT")
    assert DaemonSettings.load().http_port == 9001
    other = write(tmp_path / "other.json", json.dumps({"http_port": 9004}))
    assert DaemonSettings.load({"config": other}).http_port == 9004  # the flag's file wins


def test_the_token_in_a_file_yields_to_the_environment_and_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path / "secret.json", '{"token": "from-file"}')
    assert DaemonSettings.load({"config": config}).token == "from-file"
    monkeypatch.setenv("POLICYD_API_TOKEN", "from-env")
    assert DaemonSettings.load({"config": config}).token == "from-env"
    assert DaemonSettings.load({"config": config, "token": "from-flag"}).token == "from-flag"


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("typo.toml", "http_port = 1\nhtp_port = 2\n", "unknown setting 'htp_port'; valid: db,"),
        ("broken.toml", "http_port = [\n", "is malformed"),
        ("broken.json", '{"http_port": ', "is malformed"),
        ("list.json", "[1, 2]", "must hold an object of settings"),
        ("nested.toml", 'config = "other.toml"\n', "'config' cannot be set here"),
        ("policyd.yaml", "http_port: 1\n", "name it *.toml or *.json"),
    ],
)
def test_a_bad_settings_file_is_a_clear_error_naming_it(
    tmp_path: Path, name: str, text: str, says: str
) -> None:
    path = write(tmp_path / name, text)
    with pytest.raises(ValueError, match="settings file") as info:
        DaemonSettings.load({"config": path})
    assert says in str(info.value) and str(path) in str(info.value)


def test_a_missing_settings_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the settings file .*missing\.toml"):
        DaemonSettings.load({"config": tmp_path / "missing.toml"})


def test_a_bad_value_names_the_setting_and_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path / "p.toml", 'http_port = "many"\n')
    with pytest.raises(ValueError, match=f"settings file {config}: http_port must be an integer"):
        DaemonSettings.load({"config": config})
    monkeypatch.setenv("POLICYD_TICK_INTERVAL_S", "0")
    with pytest.raises(
        ValueError, match=r"POLICYD_TICK_INTERVAL_S='0': tick_interval_s must be in"
    ):
        DaemonSettings.load()
    monkeypatch.delenv("POLICYD_TICK_INTERVAL_S")
    with pytest.raises(ValueError, match=r"^tick_interval_s must be in \(0, 31622400\], got 0"):
        DaemonSettings.load({"tick_interval_s": 0.0})  # a flag: the setting alone


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("checkpoint_interval_s", float("inf"), "must be a finite number"),
        ("idle_timeout_s", 1e308, "idle_timeout_s must be in (0, 31622400]"),
        ("history_retention_s", -1.0, "history_retention_s must be in (0, 31622400]"),
        ("heap_trim_interval_s", 1e308, "heap_trim_interval_s must be in [0, 31622400]"),
        ("history_cpu_budget", -0.5, "history_cpu_budget must be >= 0"),
        ("shards_rate", float("nan"), "shards_rate must be a finite number in (0, 1]"),
        ("http_port", 65536, "http_port must be in [0, 65535]"),
        ("http_port", -1, "http_port must be in [0, 65535]"),
        ("max_sources", 0, "max_sources must be in [1, 10000000]"),
        ("events", "localhost:5557", "events must be a ZeroMQ endpoint"),
        ("vllm_events", "vllm:5557", "vllm_events must be a ZeroMQ endpoint"),
        ("policy", "belady", "unknown policy 'belady'; valid: agentkv, efficientagent"),
        ("profile", "h100", "unknown profile 'h100'; valid: h200-llama3.1-8b"),
        ("token", " ", "token is empty"),
        ("shed_above_frames", 4096, "shed_above_frames must be below ingest_queue_frames"),
    ],
)
def test_extreme_fixed_settings_are_refused_naming_the_setting(
    name: str, value: object, says: str
) -> None:
    with pytest.raises(ValueError) as info:
        DaemonSettings.load({name: value})
    assert says in str(info.value)


def test_a_copy_made_by_replace_is_validated_again_by_check() -> None:
    base = DaemonSettings.load()
    with pytest.raises(ValueError, match="tick_interval_s must be in"):
        base.replace(tick_interval_s=-1.0).check()
    with pytest.raises(ValueError, match="without a token"):
        base.replace(http_host="0.0.0.0").check()
    base.replace(http_port=0).check()


def test_an_empty_switch_or_endpoint_in_the_environment_is_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POLICYD_ALLOW_OPEN_HTTP", "")
    monkeypatch.setenv("POLICYD_VLLM_EVENTS", "")
    settings = DaemonSettings.load()
    assert settings.allow_open_http is False and settings.vllm_events is None
    monkeypatch.setenv("POLICYD_ALLOW_OPEN_HTTP", "yes")
    assert DaemonSettings.load().allow_open_http is True
    monkeypatch.setenv("POLICYD_ALLOW_OPEN_HTTP", "maybe")
    with pytest.raises(ValueError, match="POLICYD_ALLOW_OPEN_HTTP='maybe'"):
        DaemonSettings.load()


def test_serve_flags_are_generated_from_every_setting(tmp_path: Path) -> None:
    parser = serve_parser()
    flags = {flag for action in parser._actions for flag in action.option_strings}
    for name, _, _ in DaemonSettings.describe():
        assert "--" + name.replace("_", "-") in flags, name
    assert set(FLAGS_BEFORE) <= flags
    config = write(tmp_path / "p.toml", "http_port = 9001\nmax_sources = 7\n")
    given = vars(
        parser.parse_args(
            ["--config", str(config), "--policy", "lru", "--allow-open-http", "--max-sources", "9"]
        )
    )
    given.pop("log_level")
    settings = DaemonSettings.load(given)
    assert (settings.http_port, settings.policy, settings.max_sources) == (9001, "lru", 9)
    assert settings.allow_open_http is True and settings.sql_without_token is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--policy", "belady"])  # the choices are the field's
    # `policyd serve`'s stub passes every flag through, unparsed
    args = build_parser().parse_args(["serve", "--db", "x.duckdb", "--help"])
    assert args.command == "serve" and args.flags == ["--db", "x.duckdb", "--help"]


def test_building_the_parser_imports_no_pydantic_and_serve_help_lists_the_settings() -> None:
    probe = "import sys\nimport policyd.cli as cli\ncli.build_parser()\nprint(sorted(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout
    assert "pydantic" not in out
    shown = subprocess.run(
        [sys.executable, "-m", "policyd.cli", "serve", "--help"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert shown.startswith("usage: policyd serve")
    assert "--max-active-workflows" in shown and "[POLICYD_API_TOKEN]" in shown


def test_the_change_schema_is_the_tunables_none_required_no_others() -> None:
    schema = TunablesChange.model_json_schema()
    assert list(schema["properties"]) == list(Tunables.model_fields) == list(tunables())
    assert "required" not in schema and schema["additionalProperties"] is False
    assert {"type": "integer", "minimum": 1}.items() <= schema["properties"]["lookahead_k"].items()
    good, errors = validate_tunables({"discount": None, "lookahead_k": 2})
    assert good == {"lookahead_k": 2} and "discount must be a number" in errors["discount"]


def test_the_tuning_form_is_built_from_the_schema() -> None:
    fields = {field.key: field for field in form_fields(tunables_schema())}
    assert list(fields) == list(tunables())
    discount, k = fields["discount"], fields["lookahead_k"]
    assert (discount.kind, discount.exclusive_minimum, discount.maximum) == ("number", 0, 1)
    assert discount.help_text().endswith("(> 0.0, <= 1.0)")
    assert (k.kind, k.minimum, k.maximum) == ("integer", 1, 8)
    assert fields["policy"].choices == ("agentkv", "efficientagent", "kvflow", "lru", "pbkv")
    assert all(field.help for field in fields.values())
    for key, tunable in tunables().items():  # the same bounds the API lists per row
        field = fields[key]
        low = field.exclusive_minimum if tunable.min_exclusive else field.minimum
        assert (low, field.maximum) == (tunable.min, tunable.max), key
