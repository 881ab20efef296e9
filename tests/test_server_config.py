"""agg_server.config: every validation rule names its TOML key; the example file documents the defaults."""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from agg_server.config import (
    EnrollmentSection,
    FELBSection,
    FNMFSection,
    IALSSection,
    LightFRSection,
    ListenConfig,
    LogSection,
    MFSection,
    ModelSection,
    PrivacySection,
    RoundSection,
    ServerConfig,
    StorageSection,
    config_from_dict,
    lightfr_keys,
    load_config,
)
from protocol.errors import ConfigError
from protocol.plan import LightFRParams

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "server.toml"


def _minimal() -> dict[str, dict[str, Any]]:
    return {"server": {"data_dir": "data"}, "model": {"n_items": 100}}


def _build(section: str, key: str, value: object, base: Path = Path("/srv")) -> ServerConfig:
    data = _minimal()
    data.setdefault(section, {})[key] = value
    return config_from_dict(data, base_dir=base)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "server.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- the example file ------------------------------------------------------------------------------


def test_example_loads_and_states_the_defaults() -> None:
    config = load_config(EXAMPLE)
    # Outside the checkout: running the example never writes into the repository.
    assert config.data_dir == Path("~/.local/share/fedrec/example-server").expanduser()
    # Every value in the example is the default but privacy.enabled: the example runs with DP on, so that a
    # device with the SDK's default PrivacyPolicy (it refuses rounds without noise) can join its rounds.
    defaults = config_from_dict(
        {
            "server": {"data_dir": "~/.local/share/fedrec/example-server"},
            "model": {"n_items": 1682},
            "privacy": {"enabled": True},
        },
        base_dir=EXAMPLE.parent,
    )
    assert config == defaults
    assert PrivacySection().enabled is False  # the code's default stays off (tests and simulations of tiny cohorts)


def test_example_lists_every_key() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    tables = {
        "server": ["data_dir", *[f.name for f in dataclasses.fields(ListenConfig)]],
        "model": [f.name for f in dataclasses.fields(ModelSection)],
        "lightfr": lightfr_keys(),
        "rounds": [f.name for f in dataclasses.fields(RoundSection)],
        "privacy": [f.name for f in dataclasses.fields(PrivacySection)],
        "log": [f.name for f in dataclasses.fields(LogSection)],
        "mf": [f.name for f in dataclasses.fields(MFSection)],
        "felb": [f.name for f in dataclasses.fields(FELBSection)],
        "fnmf": [f.name for f in dataclasses.fields(FNMFSection)],
        "ials": [f.name for f in dataclasses.fields(IALSSection)],
        "storage": [f.name for f in dataclasses.fields(StorageSection)],
        "enrollment": [f.name for f in dataclasses.fields(EnrollmentSection)],
    }
    sections = re.split(r"^\[(\w+)\]$", text, flags=re.MULTILINE)
    bodies = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert set(bodies) == set(tables)
    for table, keys in tables.items():
        for key in keys:
            line = re.search(rf"^(# )?{key} = .+# .+$", bodies[table], flags=re.MULTILINE)
            assert line, f"{table}.{key} is not documented in {EXAMPLE.name}"


def test_defaults_match_the_brief() -> None:
    config = config_from_dict(_minimal(), base_dir=Path("/srv"))
    assert config.listen == ListenConfig(host="127.0.0.1", port=8080, max_body_bytes=64 << 20)
    assert (config.model.kind, config.lightfr.server.bits, config.lightfr.params.aggregation) == ("lightfr", 64, "grad")
    assert config.rounds.cohort_size == 50 and config.rounds.seed is None and config.rounds.k is None
    assert config.rounds.masked_input_timeout == 120.0
    assert config.privacy == PrivacySection(enabled=False, epsilon=8.0, delta=1e-5, planned_rounds=10)
    assert config.log == LogSection(format="text", level="info")


# -- paths -----------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_file_folder(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "cert.pem").write_text("cert")
    (tmp_path / "tls" / "key.pem").write_text("key")
    path = _write(
        tmp_path,
        '[server]\ndata_dir = "state"\ntls_cert = "tls/cert.pem"\ntls_key = "tls/key.pem"\n[model]\nn_items = 10\n',
    )
    config = load_config(path)
    assert config.data_dir == tmp_path.resolve() / "state"
    assert config.listen.tls_cert == tmp_path.resolve() / "tls" / "cert.pem"
    assert config.listen.tls_key == tmp_path.resolve() / "tls" / "key.pem"


def test_absolute_data_dir_is_kept(tmp_path: Path) -> None:
    config = _build("server", "data_dir", str(tmp_path / "abs"), base=Path("/elsewhere"))
    assert config.data_dir == tmp_path / "abs"


def test_tls_needs_both_files(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("cert")
    with pytest.raises(ConfigError, match=r"^server\.tls_key: .* must be set together"):
        _build("server", "tls_cert", str(cert))
    with pytest.raises(ConfigError, match=r"^server\.tls_cert: .*together"):
        _build("server", "tls_key", str(cert))
    data = _minimal()
    data["server"].update(tls_cert=str(cert), tls_key=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match=r"^server\.tls_key: file .*missing\.pem.* does not exist"):
        config_from_dict(data, base_dir=tmp_path)


# -- unknown, missing, malformed -------------------------------------------------------------------


def test_unknown_key_with_hint() -> None:
    with pytest.raises(ConfigError, match=re.escape("model.bitz: unknown key (did you mean 'bits'?)")):
        _build("model", "bitz", 32)


def test_unknown_key_without_a_close_match() -> None:
    with pytest.raises(ConfigError, match=r"^rounds\.zzzzzz: unknown key$"):
        _build("rounds", "zzzzzz", 1)


def test_unknown_section_with_hint() -> None:
    data: dict[str, Any] = {**_minimal(), "round": {"cohort_size": 10}}
    with pytest.raises(ConfigError, match=re.escape("round: unknown section (did you mean 'rounds'?)")):
        config_from_dict(data, base_dir=Path("/srv"))


def test_section_must_be_a_table() -> None:
    data: dict[str, Any] = {**_minimal(), "log": "json"}
    with pytest.raises(ConfigError, match=r"^log: must be a table, got 'json'"):
        config_from_dict(data, base_dir=Path("/srv"))


@pytest.mark.parametrize(("section", "key"), [("server", "data_dir"), ("model", "n_items")])
def test_required_keys(section: str, key: str) -> None:
    data = _minimal()
    del data[section][key]
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: required key is missing"):
        config_from_dict(data, base_dir=Path("/srv"))


def test_invalid_toml_reports_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\ndata_dir = "d"\n\n[model]\nn_items = = 3\n')
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 5, column \d+") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_bytes(b'[server]\ndata_dir = "\xff"\n')
    with pytest.raises(ConfigError, match="invalid TOML: not UTF-8"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_config(tmp_path / "nope.toml")


def test_load_config_names_file_and_key(tmp_path: Path) -> None:
    text = '[server]\ndata_dir = "d"\n[model]\nn_items = 10\n[rounds]\ncohort_size = "ten"\n'
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: rounds.cohort_size: must be an integer >= 3, got 'ten'"


# -- every rule names its key ----------------------------------------------------------------------

BAD_VALUES = [
    ("server", "host", "", "must be a non-empty string"),
    ("server", "port", 70000, "must be an integer in [0, 65535]"),
    ("server", "port", -1, "must be an integer in [0, 65535]"),
    ("server", "port", "8080", "must be an integer"),
    ("server", "port", True, "must be an integer"),
    ("server", "max_body_bytes", 0, "must be an integer >= 1"),
    ("server", "data_dir", 3, "must be a non-empty path"),
    ("server", "tls_cert", "", "must be a non-empty path"),
    ("model", "kind", "svd", "must be one of"),
    ("model", "n_items", 0, "must be an integer in [1, 67108864]"),
    ("model", "n_items", 1.5, "must be an integer"),
    ("model", "bits", 0, "must be an integer in [1, 4096]"),
    ("model", "bits", 5000, "must be an integer in [1, 4096]"),
    ("model", "bits", True, "must be an integer"),
    ("model", "lam", -0.5, "must be a finite number >= 0.0"),
    ("model", "lam", math.nan, "must be a finite number"),
    ("model", "lam", "0", "must be a finite number"),
    ("model", "negatives", -1, "must be an integer >= 0"),
    ("model", "local_epochs", 0, "must be an integer in [1, 1000]"),
    ("model", "max_sweeps", 1001, "must be an integer in [1, 1000]"),
    ("model", "aggregation", "sum", "must be one of 'grad', 'para'"),
    ("model", "flip_fraction", 0, "must be a finite number in (0.0, 1.0]"),
    ("model", "flip_fraction", 1.5, "must be a finite number in (0.0, 1.0]"),
    ("model", "binary_positives", True, "no longer a server setting: the rating scale"),
    ("model", "rating_min", 1.0, "no longer a server setting"),
    ("model", "rating_max", 5.0, "LightFRConfig(rating_range=...,"),
    ("rounds", "cohort_size", "ten", "must be an integer >= 3, got 'ten'"),
    ("rounds", "cohort_size", 2, "must be an integer >= 3"),
    ("rounds", "min_cohort", 2, "must be an integer >= 3"),
    ("rounds", "min_cohort", 51, "must be <= rounds.cohort_size (50)"),
    ("rounds", "dropout_rate", 1.0, "must be a finite number in [0.0, 1.0)"),
    ("rounds", "dropout_rate", -0.1, "must be a finite number in [0.0, 1.0)"),
    ("rounds", "adversary_rate", 1, "must be a finite number in [0.0, 1.0)"),
    ("rounds", "clip_norm", 0, "must be a finite number > 0.0"),
    ("rounds", "clip_norm", math.inf, "must be a finite number > 0.0"),
    ("rounds", "scale_bits", 31, "must be an integer in [0, 30]"),
    ("rounds", "scale_bits", -1, "must be an integer in [0, 30]"),
    ("rounds", "example_cap", -1, "must be an integer >= 0"),
    ("rounds", "advertise_timeout", 0, "must be a finite number > 0.0"),
    ("rounds", "share_keys_timeout", -1.0, "must be a finite number > 0.0"),
    ("rounds", "masked_input_timeout", "2m", "must be a finite number > 0.0"),
    ("rounds", "unmask_timeout", math.nan, "must be a finite number > 0.0"),
    ("rounds", "round_interval", -1, "must be a finite number >= 0.0"),
    ("rounds", "max_rounds", -1, "must be an integer >= 0"),
    ("rounds", "seed", -1, "must be an integer >= 0"),
    ("rounds", "seed", 1.5, "must be an integer >= 0"),
    ("privacy", "enabled", "yes", "must be true or false"),
    ("privacy", "epsilon", 0, "must be a finite number > 0.0"),
    ("privacy", "delta", 0, "must be a finite number in (0.0, 1.0)"),
    ("privacy", "delta", 1, "must be a finite number in (0.0, 1.0)"),
    ("privacy", "planned_rounds", 0, "must be an integer >= 1"),
    ("log", "format", "xml", "must be one of 'text', 'json'"),
    ("log", "level", "verbose", "must be one of 'debug', 'info', 'warning', 'error', 'critical'"),
    ("log", "level", 10, "must be one of"),
]


@pytest.mark.parametrize(("section", "key", "value", "message"), BAD_VALUES)
def test_bad_value_names_the_key(section: str, key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _build(section, key, value)
    text = str(info.value)
    assert text.startswith(f"{section}.{key}: "), text
    assert message in text


@pytest.mark.parametrize(
    ("rounds", "key", "message"),
    [
        ({"k": 21}, "rounds.t", "rounds.k and rounds.t must be set together"),
        ({"t": 3}, "rounds.k", "rounds.k and rounds.t must be set together"),
        ({"k": 5, "t": 6}, "rounds.t", "must be an integer in [1, 5]"),
        ({"k": 21, "t": 0}, "rounds.t", "must be an integer in [1, 21]"),
        ({"k": 51, "t": 3}, "rounds.k", "must be an integer in [1, 50]"),
        ({"k": 21, "t": 1}, "rounds.t", "unsafe for rounds.cohort_size=50"),
        ({"k": 3, "t": 2}, "rounds.t", "unsafe"),
        ({"dropout_rate": 0.5, "adversary_rate": 0.5}, "rounds.cohort_size", "no safe SecAgg+ graph"),
        ({"clip_norm": 1e9, "scale_bits": 30}, "rounds.scale_bits", "does not fit a signed 32-bit"),
    ],
)
def test_round_cross_field_rules(rounds: dict[str, Any], key: str, message: str) -> None:
    data = _minimal()
    data["rounds"] = rounds
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, base_dir=Path("/srv"))
    assert str(info.value).startswith(f"{key}: ") and message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("model", "key", "message"),
    [
        ({"unobserved_weight": 0, "code_sweeps": 3}, "model.code_sweeps", "needs the all-items objective"),
        ({"unobserved_weight": 0, "query_planes": 2}, "model.query_planes", "needs the all-items objective"),
    ],
)
def test_lightfr_keys_the_objective_would_ignore_are_refused(model: dict[str, Any], key: str, message: str) -> None:
    data = _minimal()
    data["model"].update(model)
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, base_dir=Path("/srv"))
    assert str(info.value).startswith(f"{key}: ") and message in str(info.value), str(info.value)
    # The same keys where they act are accepted.
    data["model"] = {"n_items": 100, "query_planes": 2, "user_reg": 3.0, "code_sweeps": 3}
    config = config_from_dict(data, base_dir=Path("/srv"))
    lightfr = config.lightfr
    assert (lightfr.params.query_planes, lightfr.params.user_reg, lightfr.server.code_sweeps) == (2, 3.0, 3)


_LIGHTFR_ONLY = lightfr_keys()
# A value other than each LightFR key's default (all valid for LightFR, so only the kind can refuse them).
_CHANGED: dict[str, Any] = {
    "bits": 32,
    "lam": 0.01,
    "negatives": 2,
    "local_epochs": 2,
    "max_sweeps": 3,
    "aggregation": "para",
    "flip_fraction": 0.3,
    "unobserved_weight": 0.05,
    "confidence": 1.0,
    "hamming_weight": 3,
    "unobserved_scale": 0.5,
    "counts_share": 0.2,
    "popularity_span": 1.0,
    "mean_field": False,
    "query_planes": 2,
    "user_reg": 3.0,
    "code_sweeps": 4,
}


def test_every_lightfr_key_has_a_changed_value_in_the_test() -> None:
    assert sorted(_CHANGED) == sorted(_LIGHTFR_ONLY)


@pytest.mark.parametrize("kind", ["mf", "felb", "fnmf", "ials"])
@pytest.mark.parametrize("key", _LIGHTFR_ONLY)
def test_lightfr_keys_are_refused_under_another_kind(kind: str, key: str) -> None:
    data = _minimal()
    data["model"].update(kind=kind, **{key: _CHANGED[key]})
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, base_dir=Path("/srv"))
    text = str(info.value)
    assert text.startswith(f"model.{key}: a LightFR setting") and f'model.kind = "{kind}"' in text, text
    assert "model.kind, model.n_items and the [" + kind + "] table" in text and repr(_CHANGED[key]) in text, text


def test_lightfr_keys_at_their_defaults_load_under_another_kind() -> None:
    # examples/server.toml lists every key at its default: switching its kind must load.
    text = EXAMPLE.read_text(encoding="utf-8").replace('kind = "lightfr"', 'kind = "mf"', 1)
    config = config_from_dict(tomllib.loads(text), base_dir=EXAMPLE.parent)
    assert config.model.kind == "mf" and config.mf == MFSection()
    # An int for a float default is the default; a bool is never a number, nor a number a bool.
    ok = {"kind": "fnmf", "n_items": 100, "lam": 0, "user_reg": 1, "unobserved_weight": "auto", "mean_field": True}
    assert config_from_dict({**_minimal(), "model": ok}, base_dir=Path("/srv")).model.kind == "fnmf"
    for key, value in (("mean_field", 1), ("negatives", True), ("bits", 64.5)):
        with pytest.raises(ConfigError, match=rf"^model\.{key}: a LightFR setting"):
            config_from_dict({**_minimal(), "model": {"kind": "mf", "n_items": 100, key: value}}, base_dir=Path("/srv"))
    # In code as from TOML.
    section = LightFRSection(params=LightFRParams(query_planes=2))
    with pytest.raises(ConfigError, match=r'^lightfr: the \[lightfr\] table configures model\.kind = "lightfr"'):
        ServerConfig(data_dir=Path("d"), model=ModelSection(kind="felb", n_items=10), lightfr=section)


@pytest.mark.parametrize(
    ("kind", "table", "key", "value"),
    [
        ("lightfr", "mf", "rank", 4),
        ("mf", "felb", "local_epochs", 3),
        ("felb", "fnmf", "alignment", "none"),
        ("fnmf", "ials", "alpha", 5.0),
    ],
)
def test_another_familys_table_changed_is_refused(kind: str, table: str, key: str, value: object) -> None:
    data = _minimal()
    data["model"]["kind"] = kind
    data[table] = {key: value}
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, base_dir=Path("/srv"))
    text = str(info.value)
    assert text.startswith(f'{table}.{key}: the [{table}] table configures model.kind = "{table}"'), text
    assert f'unused with model.kind = "{kind}"' in text and repr(value) in text, text
    data["model"]["kind"] = table  # where it acts
    assert getattr(getattr(config_from_dict(data, base_dir=Path("/srv")), table), key) == value


def test_the_vector_length_limit_of_another_kind_is_its_rank_not_model_bits() -> None:
    # model.bits (64 by default) is LightFR's: 2**23 items of MF rank 32 fill exactly 2**28.
    data = {**_minimal(), "model": {"kind": "mf", "n_items": 1 << 23}, "mf": {"rank": 32}}
    assert config_from_dict(data, base_dir=Path("/srv")).model.n_items == 1 << 23
    data["mf"] = {"rank": 33}
    with pytest.raises(ConfigError, match=r"^mf\.rank: an upload of n_items = 8388608 and rank 33 has .* above"):
        config_from_dict(data, base_dir=Path("/srv"))


def test_the_vector_length_limit_counts_the_familys_whole_upload() -> None:
    # iALS uploads m·d + m + 2d² + 1 elements: m·d alone at the limit is already too long.
    m = 1 << 22
    data = {**_minimal(), "model": {"kind": "ials", "n_items": m}, "ials": {"rank": 64}}
    with pytest.raises(ConfigError, match=r"^ials\.rank: an upload of n_items = 4194304 and rank 64 has 272637953 "):
        config_from_dict(data, base_dir=Path("/srv"))
    data["ials"] = {"rank": 62}
    assert config_from_dict(data, base_dir=Path("/srv")).ials.rank == 62
    # LightFR's all-items objective adds 2m + f² + f to m·f.
    data = {**_minimal(), "model": {"kind": "lightfr", "n_items": 1 << 22}}
    with pytest.raises(ConfigError, match=r"^model\.n_items: an upload of n_items = 4194304 and bits = 64 has "):
        config_from_dict(data, base_dir=Path("/srv"))


@pytest.mark.parametrize(("key", "value"), [("epsilon", 2.0), ("delta", 1e-6), ("planned_rounds", 50)])
def test_privacy_keys_without_privacy_enabled_are_refused(key: str, value: object) -> None:
    # A budget written without enabled = true left the rounds without noise, silently.
    data = _minimal()
    data["privacy"] = {key: value}
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, base_dir=Path("/srv"))
    text = str(info.value)
    assert text.startswith(f"privacy.{key}: set to {value!r} while privacy.enabled is false"), text
    assert "set privacy.enabled = true, or delete it" in text
    data["privacy"]["enabled"] = True
    assert getattr(config_from_dict(data, base_dir=Path("/srv")).privacy, key) == value
    # At their defaults (as examples/server.toml lists them) they load without DP.
    data["privacy"] = {"enabled": False, "epsilon": 8, "delta": 1e-5, "planned_rounds": 10}
    assert not config_from_dict(data, base_dir=Path("/srv")).privacy.enabled


def test_graph_override_accepted_when_safe() -> None:
    data = _minimal()
    data["rounds"] = {"k": 21, "t": 4}
    assert config_from_dict(data, base_dir=Path("/srv")).rounds.k == 21


def test_graph_override_refused_when_a_placing_server_reaches_t() -> None:
    # 2 colluders of 50 placed around one device plus its own share reach t = 3 (protocol 1.9)
    data = _minimal()
    data["rounds"] = {"k": 21, "t": 3}
    with pytest.raises(ConfigError, match=r"^rounds\.t: unsafe .*places its 2 colluders.*need t >= 4"):
        config_from_dict(data, base_dir=Path("/srv"))


def test_vector_length_limit() -> None:
    data = _minimal()
    data["model"] = {"n_items": 1 << 22, "bits": 128}
    with pytest.raises(ConfigError, match=r"^model\.n_items: an upload of n_items = 4194304 .* above .* 2\*\*28"):
        config_from_dict(data, base_dir=Path("/srv"))
    # 64-bit codes of 4,000,000 items under the all-items objective: m·f + 2m + f² + f = 264,004,160 elements.
    data["model"] = {"n_items": 4_000_000, "bits": 64}
    assert config_from_dict(data, base_dir=Path("/srv")).model.n_items == 4_000_000


def test_int_is_accepted_for_a_float_and_stored_as_float() -> None:
    config = _build("privacy", "epsilon", 8)
    assert config.privacy.epsilon == 8.0 and type(config.privacy.epsilon) is float
    assert type(_build("rounds", "round_interval", 0).rounds.round_interval) is float


def test_log_level_is_case_insensitive() -> None:
    assert _build("log", "level", "WARNING").log.level == "warning"


# -- built in code ---------------------------------------------------------------------------------


def test_dataclasses_validate_when_built_in_code() -> None:
    with pytest.raises(ConfigError, match=r"^model\.n_items: "):
        ModelSection(n_items=0)
    with pytest.raises(ConfigError, match=r"^rounds\.min_cohort: "):
        RoundSection(cohort_size=5, min_cohort=6)
    with pytest.raises(ConfigError, match=r"^server\.port: "):
        ListenConfig(port=99999)
    with pytest.raises(ConfigError, match=r"^model: must be a ModelSection"):
        ServerConfig(data_dir=Path("d"), model={"n_items": 3})  # type: ignore[arg-type]


def test_replace_revalidates_and_objects_are_frozen() -> None:
    config = ServerConfig(data_dir="d", model=ModelSection(n_items=10))  # type: ignore[arg-type]
    assert config.data_dir == Path("d")
    with pytest.raises(ConfigError, match=r"^log\.format: "):
        dataclasses.replace(config.log, format="xml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rounds.cohort_size = 3  # type: ignore[misc]


def test_storage_url_names_its_scheme(tmp_path: Path) -> None:
    from agg_server.config import config_from_dict

    base = {"server": {"data_dir": str(tmp_path)}, "model": {"n_items": 10}}
    cfg = config_from_dict({**base, "storage": {"url": "postgresql://u:p@db/fedrec"}}, base_dir=tmp_path)
    assert cfg.storage.url == "postgresql://u:p@db/fedrec"
    with pytest.raises(ConfigError, match=r"^storage\.url: must start with postgresql://") as info:
        config_from_dict({**base, "storage": {"url": "mysql://u:secret@db/x"}}, base_dir=tmp_path)
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^rounds\.disconnect_grace"):
        config_from_dict({**base, "rounds": {"disconnect_grace": -1}}, base_dir=tmp_path)


# -- the [lightfr] table -------------------------------------------------------------------------------


def test_lightfr_table_and_the_older_model_keys_build_the_same_config() -> None:
    keys = {"bits": 32, "lam": 0.01, "query_planes": 2, "code_sweeps": 3, "unobserved_weight": 0.05}
    new = config_from_dict({**_minimal(), "lightfr": keys}, base_dir=Path("/srv"))
    data = _minimal()
    data["model"].update(keys)
    assert config_from_dict(data, base_dir=Path("/srv")) == new
    assert new.lightfr.params == LightFRParams(lam=0.01, query_planes=2, unobserved_weight=0.05)
    assert (new.lightfr.server.bits, new.lightfr.server.code_sweeps, new.lightfr.server.unobserved_scale) == (32, 3, 0)
    # Split between the tables, as an operator moving keys one by one would have it.
    data = _minimal()
    data["model"].update(bits=32, lam=0.01)
    data["lightfr"] = {"query_planes": 2, "code_sweeps": 3, "unobserved_weight": 0.05}
    assert config_from_dict(data, base_dir=Path("/srv")) == new


def test_a_lightfr_key_in_both_tables_is_refused() -> None:
    data = _minimal()
    data["model"]["lam"] = 0.01
    data["lightfr"] = {"lam": 0.01}
    with pytest.raises(ConfigError, match=r"^model\.lam: also given as lightfr\.lam; .* give it once, in \[lightfr\]"):
        config_from_dict(data, base_dir=Path("/srv"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("local_epochs", 0, "must be an integer in [1, 1000], got 0"),
        ("hamming_weight", 0, "must be an integer in [1, 255], got 0"),
        ("unobserved_weight", "often", '"auto" or a number'),
        ("unobserved_scale", 0, "must be a finite number > 0"),
        ("aggregation", "sum", "must be one of 'grad', 'para'"),
        ("mean_field", 1, "must be true or false"),
    ],
)
def test_lightfr_errors_name_the_table_the_key_was_given_in(key: str, value: object, message: str) -> None:
    for table in ("lightfr", "model"):
        data = _minimal()
        data.setdefault(table, {})[key] = value
        with pytest.raises(ConfigError) as info:
            config_from_dict(data, base_dir=Path("/srv"))
        assert str(info.value).startswith(f"{table}.{key}: ") and message in str(info.value), str(info.value)


def test_lightfr_table_is_refused_under_another_kind() -> None:
    data = _minimal()
    data["model"]["kind"] = "mf"
    data["lightfr"] = {"query_planes": 2}
    with pytest.raises(
        ConfigError, match=r'^lightfr\.query_planes: the \[lightfr\] table configures model\.kind = "lig'
    ):
        config_from_dict(data, base_dir=Path("/srv"))
    data["lightfr"] = {"query_planes": 0, "unobserved_weight": "auto", "aggregation": "grad"}  # defaults: fine
    assert config_from_dict(data, base_dir=Path("/srv")).lightfr == LightFRSection()
