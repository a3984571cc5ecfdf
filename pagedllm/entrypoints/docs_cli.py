"""`pagedllm docs`: build the documentation site (MkDocs, from the checkout's docs/) and serve it locally.

The site's sources (mkdocs.yml, docs/, benchmarks/README.md) live in the repository beside the package,
not in it, so the command works from a checkout (an editable install), as the docs are written there.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "mkdocs.yml"


def add_docs_parser(sub: argparse._SubParsersAction) -> None:
    docs = sub.add_parser("docs", help="build the documentation site and serve it on localhost")
    docs.add_argument("--build", metavar="DIR", default=None,
                      help="only build the site into DIR (mkdocs build --strict) and print DIR")
    docs.add_argument("--host", default="127.0.0.1", help="address to serve on")
    docs.add_argument("--port", type=int, default=8002, help="port to serve on")
    docs.set_defaults(func=run_docs)


def build_site(site_dir: str | pathlib.Path) -> pathlib.Path:
    """Build the site with `mkdocs build --strict` into site_dir; a broken link or a missing page fails it."""
    if not CONFIG.is_file():
        raise ValueError(f"the documentation sources are not here: {CONFIG} is missing (pagedllm docs runs from "
                         "a checkout of the repository, installed with pip install -e)")
    if importlib.util.find_spec("mkdocs") is None:
        raise ValueError("MkDocs is not installed: pip install 'pagedllm[docs]' (mkdocs, mkdocs-material, "
                         "mkdocstrings-python)")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(CONFIG), "-d", str(site_dir)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's end-of-life banner, on every build
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise ValueError(f"mkdocs build failed:\n{result.stderr or result.stdout}")
    return pathlib.Path(site_dir)


def run_docs(args: argparse.Namespace) -> int:
    if args.build is not None:
        print(build_site(args.build))
        return 0
    with tempfile.TemporaryDirectory(prefix="pagedllm-docs-") as site_dir:
        build_site(site_dir)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=site_dir)
        with http.server.ThreadingHTTPServer((args.host, args.port), handler) as server:
            print(f"Documentation on http://{args.host}:{args.port}/ (Ctrl-C stops)", flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
    return 0
