"""The knob registry: strict parsing of every knob from the environment and on assignment,
unknown names with the closest known one, patch, and the README's knob table."""
import os
import re
import subprocess
import sys
import warnings

import pytest

import tilefuse
from tilefuse.config import KNOBS, Config, ConfigError, UnknownOptionError, knob_table, resolve_options

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

#: a value each knob must refuse, and one it must take (with the parsed result)
BAD_AND_GOOD = {
    "target": ("cuda", ("cpu", "cpu")),
    "autotune": ("2", ("max", "max")),
    "tuning_budget_ms": ("-5", ("500", 500)),
    "fallback": ("ignore", ("error", "error")),
    "verify": ("banana", ("yes", True)),
    "index_checks": ("Flase", ("off", False)),
    "matmul": ("cublas", ("aten", "aten")),
    "logs": ("grpah", ("fusion,code", "fusion,code")),
    "debug_dir": (None, ("/somewhere", "/somewhere")),
    "cache_dir": (None, ("/somewhere", "/somewhere")),
    "cache_lock_timeout": ("-1", ("30", 30)),
    "cache_max_bytes": ("4G", ("1073741824", 1 << 30)),
    "compile_threads": ("two", (" 3 ", 3)),
    "graph_cache": ("sometimes", ("off", False)),
    "cuda_graphs": ("2", ("on", True)),
    "generated_wrapper": ("maybe", ("0", False)),
    "kernel_runs": ("perhaps", ("off", False)),
    "persistent_reduction_limit": ("4194304", ("1024", 1024)),
    "flash_config": ("64,64,4", ("64,32,4,2", "64,32,4,2")),
    "flash_split": ("-1", ("4", 4)),
    "block_summary": ("half", ("off", False)),
    "flash_launch_groups": ("grouped", ("on", True)),
    "index_constants": ("sometimes", ("off", False)),
    "recompute": ("some", ("no", False)),
    "attention_backward": ("sometimes", ("off", False)),
    "split_reductions": ("maybe", ("0", False)),
    "column_tiles": ("sometimes", ("off", False)),
}


def test_every_knob_is_covered_here():
    assert set(BAD_AND_GOOD) == set(KNOBS)


@pytest.mark.parametrize("name", sorted(BAD_AND_GOOD))
def test_a_bad_environment_value_is_an_error_naming_the_variable(name):
    bad, (good, parsed) = BAD_AND_GOOD[name]
    env_name = KNOBS[name].env
    if bad is not None:
        with pytest.raises(ConfigError, match=re.escape(env_name)):
            Config({env_name: bad})
    assert getattr(Config({env_name: good}), name) == parsed


@pytest.mark.parametrize("name", sorted(BAD_AND_GOOD))
def test_assignment_is_checked(name):
    cfg = Config({})
    bad, (good, parsed) = BAD_AND_GOOD[name]
    if bad is not None:
        with pytest.raises(ConfigError, match=f"tilefuse.config.{name}"):
            setattr(cfg, name, bad)
    setattr(cfg, name, good)
    assert getattr(cfg, name) == parsed


def test_booleans_are_strict_and_case_blind():
    for text, value in [("1", True), ("TRUE", True), ("On", True), ("no", False), ("0", False), ("OFF", False)]:
        assert Config({"TILEFUSE_VERIFY": text}).verify is value
    for text in ("", "2", "y", "enable", "Flase"):
        with pytest.raises(ConfigError):
            Config({"TILEFUSE_INDEX_CHECKS": text})


def test_unknown_names_suggest_the_closest_knob():
    cfg = Config({})
    with pytest.raises(AttributeError, match="did you mean 'autotune'"):
        cfg.autotun = "0"
    with pytest.raises(AttributeError, match="did you mean 'autotune'"):
        cfg.autotun
    with pytest.raises(UnknownOptionError, match="did you mean 'verify'"):
        resolve_options(options={"verfiy": True})
    with pytest.raises(UnknownOptionError):
        with cfg.patch(no_such_knob=1):
            pass


def test_unknown_environment_variables_warn_once_with_the_closest_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Config({"TILEFUSE_AUTOTUNES": "0", "TILEFUSE_LOGZ": "x", "TILEFUSE_TEST_DEVICE": "cpu"})
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "TILEFUSE_AUTOTUNES" in text and "TILEFUSE_AUTOTUNE" in text.replace("TILEFUSE_AUTOTUNES", "")
    assert "TILEFUSE_LOGZ" in text and "TILEFUSE_LOGS" in text
    assert "TEST_DEVICE" not in text  # a documented non-knob variable


def test_unknown_log_channel_is_refused():
    with pytest.raises(ConfigError, match="did you mean 'graph'"):
        Config({"TILEFUSE_LOGS": "grpah"})


def test_patch_checks_every_value_before_setting_any_and_restores():
    cfg = Config({})
    with pytest.raises(ConfigError):
        with cfg.patch(autotune="max", verify="banana"):
            pass
    assert cfg.autotune == "1"  # nothing was set
    with cfg.patch(autotune="max", verify=True):
        assert (cfg.autotune, cfg.verify) == ("max", True)
    assert (cfg.autotune, cfg.verify) == ("1", False)


def test_the_old_backend_name_is_the_target_knob():
    assert Config({"TILEFUSE_BACKEND": "cpu"}).target == "cpu"
    cfg = Config({})
    cfg.backend = "interpret"
    assert cfg.target == "interpret" and cfg.backend == "interpret"


def test_modes_map_to_knobs_and_bad_modes_are_refused():
    assert resolve_options("max-autotune") == {"autotune": "max", "cuda_graphs": True}
    assert resolve_options("max-autotune-no-cudagraphs") == {"autotune": "max"}
    assert resolve_options("default") == {}
    assert resolve_options("reduce-overhead") == {"cuda_graphs": True}
    with pytest.raises(ConfigError, match="max-autotune"):
        resolve_options("fastest")
    assert resolve_options(options={"autotune": 0, "verify": "1"}) == {"autotune": "0", "verify": True}
    with pytest.raises(ConfigError, match=r"options\['flash_split'\]"):
        resolve_options(options={"flash_split": "many"})


def test_non_defaults_are_what_a_reproducer_needs():
    cfg = Config({"TILEFUSE_AUTOTUNE": "0", "TILEFUSE_MATMUL": "aten"})
    assert cfg.non_defaults() == {"autotune": "0", "matmul": "aten"}


def test_readme_knob_table_is_the_registry():
    with open(os.path.join(os.path.dirname(SRC), "README.md")) as f:
        readme = f.read()
    assert knob_table() in readme, "README's knob table is stale: paste tilefuse.config.knob_table() into it"


def test_a_bad_environment_value_stops_the_import_with_the_variable_named():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILEFUSE_")}
    env.update(PYTHONPATH=SRC, TILEFUSE_VERIFY="banana")
    out = subprocess.run([sys.executable, "-c", "import tilefuse"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "TILEFUSE_VERIFY='banana'" in out.stderr


def test_module_defaults_come_from_the_registry():
    fresh = Config({})
    for name, k in KNOBS.items():
        if name != "cache_dir":
            assert getattr(fresh, name) == k.default
    assert fresh.cache_dir.endswith("tilefuse")
    assert isinstance(tilefuse.config, Config)


def test_monkeypatch_restores_knobs_under_pytest_9(monkeypatch):
    # pytest 9 restores an attribute that is not a data descriptor by deleting it from the
    # instance: knobs are descriptors, so the value set before comes back
    before, target = tilefuse.config.verify, tilefuse.config.target
    with monkeypatch.context() as m:
        m.setattr(tilefuse.config, "verify", not before)
        m.setattr(tilefuse.config, "backend", "interpret")  # the old name of `target`
        assert tilefuse.config.verify is (not before) and tilefuse.config.target == "interpret"
    assert tilefuse.config.verify is before and tilefuse.config.target == target


def test_patch_belongs_to_its_thread():
    import threading

    cfg = Config({})
    inside, seen, errors = threading.Barrier(2), {}, []

    def compile_with(value):
        try:
            with cfg.patch(autotune=value, verify=value == "max"):
                inside.wait(timeout=30)  # both threads inside their patch at once
                seen[value] = (cfg.autotune, cfg.verify, cfg.source_of("autotune"))
                inside.wait(timeout=30)
            seen[value + " after"] = cfg.autotune
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=compile_with, args=(v,)) for v in ("0", "max")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert seen["0"] == ("0", False, "patch") and seen["max"] == ("max", True, "patch")
    assert seen["0 after"] == seen["max after"] == "1" == cfg.autotune
    assert cfg.source_of("autotune") == "default"


def test_assignment_inside_a_patch_holds_for_the_block_and_the_process():
    cfg = Config({})
    with cfg.patch(autotune="0"):
        cfg.autotune = "max"
        assert cfg.autotune == "max"
    assert cfg.autotune == "max" and cfg.source_of("autotune") == "assigned"
