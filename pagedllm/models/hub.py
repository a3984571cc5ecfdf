"""Turn a Hugging Face hub reference (``ORG/NAME``, ``ORG/NAME:QUANT``) into a local path.

huggingface_hub does the work and keeps its own cache (``HF_HOME`` / ``HF_HUB_CACHE``, or
``download_dir``), token (``HF_TOKEN``) and offline switch (``HF_HUB_OFFLINE``). Only the files the
loader reads are fetched: config, tokenizer and safetensors (``*.bin`` only where a repo has no
safetensors), or the one GGUF file chosen. huggingface_hub is imported only here, inside the
functions, so a local path never reaches it.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.model_reference import HUB_ID, is_hub_id  # noqa: F401 - is_hub_id stays importable from here

_CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
# A sentence-transformers checkpoint's module list and pooling settings: the embedding runner reads them
# (pooler_config.py) to choose pooling, and how, for runner="auto".
_SENTENCE_TRANSFORMERS = re.compile(r"modules\.json|\d+_Pooling/config\.json")
# llama.cpp's shard names; the GGUF loader reads one file.
_GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def split_hub_id(reference: str) -> tuple[str, str | None]:
    """(repo id, quant or None) of ``ORG/NAME[:QUANT]``."""
    match = HUB_ID.fullmatch(reference)
    if match is None:
        raise ValueError(f"{reference!r} is not a hub id (ORG/NAME or ORG/NAME:QUANT).")
    return match["repo"], match["quant"]


def _is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def pick_gguf(repo_id: str, repo_files: list[str], quant: str | None = None, gguf_file: str | None = None) -> str:
    """The one .gguf file of the repo a quant tag (case-insensitive, as llama.cpp's ``repo:QUANT``) or an
    explicit file name selects; without either, the repo's only .gguf file."""
    # Vision projectors sit next to the language model in many GGUF repos and are never the model.
    ggufs = sorted(f for f in repo_files if _is_gguf(f) and not posixpath.basename(f).lower().startswith("mmproj"))
    listing = ", ".join(ggufs) or "none"
    if gguf_file is not None:
        matches = [f for f in ggufs if gguf_file in (f, posixpath.basename(f))]
        if not matches:
            raise ValueError(f"{repo_id} has no GGUF file {gguf_file!r}; its .gguf files: {listing}.")
    elif quant is not None:
        tag = quant.lower()
        # A name ending in the tag wins ("Q4_K" picks "x-Q4_K.gguf" over "x-Q4_K_M.gguf"), then any name holding it.
        stems = {f: posixpath.basename(f)[: -len(".gguf")].lower() for f in ggufs}
        matches = [f for f, stem in stems.items() if re.search(rf"(^|[-._]){re.escape(tag)}$", stem)]
        matches = matches or [f for f, stem in stems.items() if tag in stem]
        if not matches:
            raise ValueError(f"{repo_id} has no .gguf file for quant {quant!r}; its .gguf files: {listing}.")
    else:
        matches = ggufs
        if not matches:
            raise ValueError(f"{repo_id} has no .gguf file (and no config.json + safetensors).")
    if len(matches) > 1:
        raise ValueError(
            f"{repo_id} has several .gguf files{f' for {quant!r}' if quant else ''}: {', '.join(matches)}. "
            f"Pick one with {repo_id}:QUANT (e.g. {repo_id}:Q4_K_M) or gguf_file / --gguf-file NAME."
        )
    if _GGUF_SHARD.search(matches[0]):
        raise ValueError(f"{repo_id}: {matches[0]} is one shard of a split GGUF; pagedllm reads single-file GGUFs.")
    return matches[0]


def choose_files(
    repo_id: str,
    repo_files: list[str],
    quant: str | None = None,
    gguf_file: str | None = None,
    tokenizer_only: bool = False,
) -> list[str]:
    """The exact repo files the engine reads (``allow_patterns`` of snapshot_download), from a listing.

    A Hugging Face checkpoint: config, generation config, tokenizer files and top-level safetensors
    (+ index), a sentence-transformers module list and pooling config; PyTorch ``*.bin`` only where there
    is no safetensors. A GGUF repo (or a quant / file
    asked for): the one .gguf file. ``tokenizer_only``: the tokenizer files and config.json.
    """
    top_level = [f for f in repo_files if "/" not in f]
    hf_files = [f for f in top_level if f in _CONFIG_FILES or f in TOKENIZER_FILES]
    if tokenizer_only and any(f in TOKENIZER_FILES for f in top_level):
        return sorted(f for f in hf_files if f != "generation_config.json")
    safetensors = [f for f in top_level if f.endswith(".safetensors")]
    # Some repos add a consolidated copy next to the sharded model-*.safetensors; the loader reads the latter.
    safetensors = [f for f in safetensors if f.startswith("model")] or safetensors
    has_config = "config.json" in top_level
    hf_files += [f for f in repo_files if _SENTENCE_TRANSFORMERS.fullmatch(f)]
    if quant is None and gguf_file is None and has_config and safetensors:
        index = [f for f in top_level if f == "model.safetensors.index.json"]
        return sorted(hf_files + safetensors + index)
    bins = [f for f in top_level if re.fullmatch(r"pytorch_model.*\.bin(\.index\.json)?", f)]
    if quant is None and gguf_file is None and has_config and bins:
        return sorted(hf_files + bins)
    if quant is None and gguf_file is None and not any(_is_gguf(f) for f in repo_files):
        raise ValueError(
            f"{repo_id} has no weights pagedllm reads (config.json + *.safetensors or pytorch_model*.bin, "
            "or a .gguf file)."
        )
    return [pick_gguf(repo_id, repo_files, quant, gguf_file)]


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be reached (it falls back to its cache on these)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module_name in ("httpx2", "httpx"):  # the HTTP client differs across huggingface_hub versions
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        errors += [module.ConnectError, module.TimeoutException]
    return tuple(errors)


def _cached_listing(repo_id: str, revision: str | None, cache_dir: str | None) -> list[str]:
    """The repo's file listing as the cache knows it: the tree huggingface_hub stored with the last
    download, else the files of the cached snapshot."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        pass
    # No stored tree: snapshot_download cannot tell a partial snapshot from a whole one, and returns it.
    folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    return [
        os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
        for root, _, names in os.walk(folder) for name in names
    ]


def _fetch(repo_id: str, revision: str | None, cache_dir: str | None, choose: Any) -> tuple[str, list[str]]:
    """(snapshot folder, chosen files): list the repo (online) or the cache, choose, download."""
    from huggingface_hub import HfApi, is_offline_mode, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    local_only = is_offline_mode()
    if not local_only:
        try:
            repo_files = HfApi().list_repo_files(repo_id, revision=revision)
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except (*_connection_errors(), HfHubHTTPError):
            # As snapshot_download does: an unreachable hub leaves the cache to answer.
            local_only = True
    if local_only:
        repo_files = _cached_listing(repo_id, revision, cache_dir)
    chosen = choose(repo_files)
    folder = snapshot_download(
        repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=chosen, local_files_only=local_only
    )
    return folder, chosen


def download_model(
    reference: str,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
    tokenizer_only: bool = False,
) -> str:
    """Local path of a hub model, fetched into the hub cache if needed: the snapshot folder of a Hugging
    Face checkpoint, or the GGUF file chosen by ``ORG/NAME:QUANT`` / ``gguf_file``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, quant = split_hub_id(reference)
    if quant is not None and gguf_file is not None:
        raise ValueError(f"Give a quant ({reference!r}) or gguf_file ({gguf_file!r}), not both.")
    cache_dir = os.path.expanduser(download_dir) if download_dir else None
    where = f"revision {revision!r} of " if revision else ""
    try:
        folder, chosen = _fetch(
            repo_id, revision, cache_dir, lambda files: choose_files(repo_id, files, quant, gguf_file, tokenizer_only)
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        offline = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        # A partial snapshot's message names the missing files; the others only repeat what we say.
        missing = f" {str(e).splitlines()[0]}" if isinstance(e, IncompleteSnapshotError) else ""
        raise ValueError(
            f"Model {where}{reference!r} is not in the hub cache ({cache_dir or constants.HF_HUB_CACHE}) and "
            f"{offline}: download it with network access (`pagedllm download {reference}`) or unset "
            f"HF_HUB_OFFLINE.{missing}"
        ) from None
    except GatedRepoError:
        raise ValueError(f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN.") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id} is not a model on the hub (or is private: set HF_TOKEN).") from None
    except RevisionNotFoundError:
        raise ValueError(f"{repo_id} has no revision {revision!r}.") from None
    except (HFValidationError, HfHubHTTPError) as e:
        raise ValueError(f"Cannot fetch {reference!r} from the hub: {type(e).__name__}: {e}") from None
    if len(chosen) == 1 and _is_gguf(chosen[0]):
        return os.path.join(folder, *chosen[0].split("/"))
    return folder


@dataclass(slots=True)
class CachedModel:
    repo_id: str
    size_on_disk: int
    size_text: str
    revisions: list[str]  # "<commit[:12]> (refs)" of each cached snapshot
    path: str


def cached_models(download_dir: str | None = None) -> list[CachedModel]:
    """The models in the hub cache (``download_dir`` or ``HF_HUB_CACHE``), by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(os.path.expanduser(download_dir) if download_dir else None)
    except CacheNotFound:
        return []
    models = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = [
            f"{rev.commit_hash[:12]}" + (f" ({', '.join(sorted(rev.refs))})" if rev.refs else "")
            for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        ]
        models.append(
            CachedModel(repo.repo_id, repo.size_on_disk, repo.size_on_disk_str, revisions, str(repo.repo_path))
        )
    return models
