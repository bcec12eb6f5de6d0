"""The ``serve run`` import path of streamkv on Ray Serve (its own module: it needs the CLI's parser).

    serve run streamkv.server.ray_entry:app_builder replicas=2 num_blocks=512 threads=1
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamkv.server.cli import build_configs, build_parser
from streamkv.server.ray_app import build_application, ray_config, resolved


def app_builder(args: Mapping[str, str]) -> Any:
    """``serve run streamkv.server.ray_entry:app_builder replicas=2 num_blocks=512``: ``serve`` flags as key=value.

    A flag without a value (``no_prefix_caching``) takes ``true``. Host and
    port are Ray Serve's (``serve run`` options / ``http_options``), not these.

    Raises:
        SystemExit: a flag argparse refuses (its message names it).
    """
    argv = ["serve"]
    for key, value in args.items():
        flag = f"--{key.replace('_', '-')}"
        argv += [flag] if str(value).lower() in ("", "true") else [flag, str(value)]
    parsed = build_parser().parse_args(argv)
    engine_config, server_config = build_configs(parsed)
    engine_config = resolved(engine_config)
    return build_application(engine_config, server_config, ray_config(parsed), parsed.threads)
