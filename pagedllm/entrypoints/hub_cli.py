"""`pagedllm download ID` (fetch a hub model into the cache, print its path) and `pagedllm models` (list the cache).

Importing this module stays cheap (no torch, no huggingface_hub) so `pagedllm --help` is quick.
"""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_flags import add_hub_args


def run_download(args: argparse.Namespace) -> int:
    from pagedllm.models.hub import download_model

    print(download_model(args.model_id, args.revision, args.download_dir, args.gguf_file))
    return 0


def run_models(args: argparse.Namespace) -> int:
    from pagedllm.models.hub import cached_models

    models = cached_models(args.download_dir)
    if not models:
        print("No models in the hub cache.")
        return 0
    width = max(len(m.repo_id) for m in models)
    for model in models:
        print(f"{model.repo_id:<{width}}  {model.size_text:>9}  {'; '.join(model.revisions)}")
    return 0


def add_hub_parsers(subparsers: argparse._SubParsersAction) -> None:
    download = subparsers.add_parser("download",
                                     help="fetch a hub model (ORG/NAME[:QUANT]) into the cache; print its path")
    download.add_argument("model_id", metavar="ID", help="ORG/NAME, or ORG/NAME:QUANT for a GGUF repo")
    add_hub_args(download)
    download.set_defaults(func=run_download)
    models = subparsers.add_parser("models", help="list the models in the hub cache: id, size, revisions")
    models.add_argument("--download-dir", default=None, help="The hub cache folder (default: HF_HOME's).")
    models.set_defaults(func=run_models)
