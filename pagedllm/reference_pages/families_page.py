"""reference/families.md: every model the engine loads (the decoder's families and the models with a
class of their own), the GGUF architectures that map onto them, and the model types it refuses."""

from __future__ import annotations

import dataclasses

from pagedllm.models import gguf_loader, registry
from pagedllm.models.families import FAMILIES, Family
from pagedllm.models.unsupported_families import UNSUPPORTED
from pagedllm.reference_pages.markdown import cell, code, page, table

_LLAMA = Family(())


def family_differences(family: Family) -> list[str]:
    """The fields where ``family`` differs from Llama's defaults, as ``name=value`` (booleans by name)."""
    parts = []
    for field in dataclasses.fields(Family):
        if field.name in ("architectures", "renames"):
            continue
        value = getattr(family, field.name)
        if value != getattr(_LLAMA, field.name):
            parts.append(field.name if value is True else f"{field.name}={value}")
    return parts


def gguf_architectures() -> dict[str, list[str]]:
    """model_type -> the GGUF architectures (llama.cpp's names) the loader maps onto it."""
    found: dict[str, list[str]] = {}
    for arch, model_type in gguf_loader.GGUF_MODEL_TYPES.items():
        found.setdefault(model_type, []).append(arch)
    # llama.cpp writes Mixtral as a "llama" with experts; the loader tells them apart by the expert count.
    found.setdefault(gguf_loader._LLAMA_WITH_EXPERTS, []).append("llama")
    return found


def own_class_models() -> dict[str, tuple[str, str]]:
    """model_type -> (architecture, module.Class) of the models the registry serves with a class of their
    own rather than the one decoder."""
    decoder_archs = {arch for family in FAMILIES.values() for arch in family.architectures}
    found = {}
    for model_type, arch in registry._MODEL_TYPE_TO_ARCH.items():
        if arch not in decoder_archs:
            module, class_name = registry._MODELS[arch]
            found[model_type] = (arch, f"pagedllm.models.{module}.{class_name}")
    return found


def anchor(model_type: str) -> str:
    """The id MkDocs' toc gives a ``## model_type`` heading: lower case, characters other than word
    characters and ``-`` dropped (model types are already such names)."""
    return "".join(ch for ch in model_type.lower() if ch.isalnum() or ch in "_-")


def render() -> str:
    gguf = gguf_architectures()
    own = own_class_models()
    served = sorted({*FAMILIES, *own})
    unknown = sorted(set(gguf) - set(served))
    if unknown:  # a GGUF mapping onto a model type nothing serves would be a broken row
        raise ValueError(f"GGUF architectures map onto model types nothing serves: {unknown}")
    rows = []
    for model_type in served:
        archs = FAMILIES[model_type].architectures if model_type in FAMILIES else (own[model_type][0],)
        rows.append([f"[{code(model_type)}](#{anchor(model_type)})", ", ".join(code(arch) for arch in archs),
                     ", ".join(code(arch) for arch in gguf.get(model_type, ())),
                     "the decoder" if model_type in FAMILIES else "own model class"])
    body = [
        f"## Served ({len(served)})",
        "",
        "The decoder's families and the models with a model class of their own. A Hugging Face checkpoint is "
        "matched by its `model_type` (and `architectures`), a GGUF file by its `general.architecture` "
        f"(`{gguf_loader._LLAMA_WITH_EXPERTS}`'s is `llama` with experts). Each model type's section says what "
        "sets it apart from Llama.",
        "",
        *table(("model_type", "architectures", "GGUF architecture", "served by"), rows),
        "",
    ]
    for model_type in served:
        body += _section(model_type, FAMILIES.get(model_type), own.get(model_type), gguf.get(model_type, []))
    body += [
        f"## Not served ({len(UNSUPPORTED)})",
        "",
        "Causal-LM model types of transformers the decoder does not serve, with what it lacks for each; loading "
        "one is an error naming the reason.",
        "",
        *table(("model_type", "what the decoder lacks"),
               [[code(model_type), cell(reason)] for model_type, reason in sorted(UNSUPPORTED.items())]),
    ]
    return page(
        "Model families",
        "Generated from the family table (`pagedllm/models/families.py`), the model registry "
        "(`pagedllm/models/registry.py`), the GGUF loader's architecture table (`pagedllm/models/gguf_loader.py`) "
        "and the unsupported table (`pagedllm/models/unsupported_families.py`).",
        body,
    )


def _section(model_type: str, family: Family | None, own: tuple[str, str] | None, gguf: list[str]) -> list[str]:
    lines = [f"## {model_type}", ""]
    archs = family.architectures if family is not None else (own[0],)
    lines.append(f"- Architectures: {', '.join(code(arch) for arch in archs)}")
    if gguf:
        lines.append(f"- GGUF architecture: {', '.join(code(arch) for arch in gguf)}")
    if family is None:
        lines += [f"- Served by its own model class, {code(own[1])}.", ""]
        return lines
    lines.append("- Served by the one decoder (`pagedllm.models.decoder.DecoderForCausalLM`).")
    differences = family_differences(family)
    if differences:
        lines.append("- Differs from Llama by: " + ", ".join(code(item) for item in differences) + ".")
    else:
        lines.append("- Differs from Llama by nothing but its config settings.")
    if family.renames:
        lines.append("- Checkpoint renames: " + ", ".join(f"{code(old.strip('.'))} → {code(new.strip('.'))}"
                                                       for old, new in family.renames) + ".")
    return [*lines, ""]
