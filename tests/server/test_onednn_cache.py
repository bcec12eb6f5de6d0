"""``serve --onednn-cache-capacity``: the bound reaches the serving process's environment before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import CollectorRegistry

from streamkv.server.onednn_cache import DEFAULT_CAPACITY, ENV_VARS, apply_capacity, register_capacity_gauge

# Runs `streamkv serve` with serve() replaced by a recorder: what the process holds when the model would load.
_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import streamkv.server.cli as cli

    def record(*args, **kwargs):
        print(json.dumps({"torch_loaded": "torch" in sys.modules,
                          "env": {k: os.environ.get(k) for k in ENV_VARS}}))

    cli.serve = record
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
    """
).replace("ENV_VARS", repr(ENV_VARS))


def _serve_env(argv: list[str], extra_env: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS} | extra_env
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_flag_is_in_the_environment_before_torch_loads() -> None:
    seen = _serve_env(["--onednn-cache-capacity", "77"], {})
    assert seen == {"torch_loaded": False, "env": {name: "77" for name in ENV_VARS}}


def test_the_default_bounds_both_caches() -> None:
    seen = _serve_env([], {})
    assert seen["env"] == {name: str(DEFAULT_CAPACITY) for name in ENV_VARS}
    assert DEFAULT_CAPACITY < 1024  # below the libraries' own default, or the flag bounds nothing new


def test_a_variable_the_user_set_wins() -> None:
    seen = _serve_env(["--onednn-cache-capacity", "77"], {"LRU_CACHE_CAPACITY": "9"})
    assert seen["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "77", "LRU_CACHE_CAPACITY": "9"}


@pytest.mark.parametrize("argv", [["--onednn-cache-capacity", "0"], ["--onednn-cache-capacity", "many"]])
def test_a_bad_capacity_is_a_usage_error(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    done = subprocess.run(
        [sys.executable, "-m", "streamkv", "serve", *argv], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--onednn-cache-capacity" in done.stderr and "Traceback" not in done.stderr


def test_a_bad_user_variable_is_refused_naming_it() -> None:
    env: dict[str, str] = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "lots"}
    with pytest.raises(ValueError, match="ONEDNN_PRIMITIVE_CACHE_CAPACITY='lots'"):
        apply_capacity(64, env)
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS} | {"LRU_CACHE_CAPACITY": "lots"}
    done = subprocess.run(
        [sys.executable, "-m", "streamkv", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "$LRU_CACHE_CAPACITY='lots'" in done.stderr and "Traceback" not in done.stderr


def test_the_gauge_reports_each_cache_capacity() -> None:
    env: dict[str, str] = {"LRU_CACHE_CAPACITY": "9"}
    assert apply_capacity(64, env) == {"onednn": 64, "ideep": 9}
    registry = CollectorRegistry()
    register_capacity_gauge(registry, env)
    for cache, want in (("onednn", 64), ("ideep", 9)):
        assert registry.get_sample_value("streamkv_onednn_cache_capacity", {"cache": cache}) == want
