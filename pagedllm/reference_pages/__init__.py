"""Reference pages of the documentation site, generated from the code: settings, request fields,
metrics and model families, as Markdown.

``PAGES`` maps each page's site path to its renderer; mkdocs_hook.py adds them to a MkDocs build.
The renderers' modules (which import the server, the CLI and the model registry) are imported
only when a page is rendered, so importing this package stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# site path -> module under pagedllm.reference_pages whose render() writes it.
_MODULES = {
    "reference/settings.md": "settings_page",
    "reference/requests.md": "requests_page",
    "reference/metrics.md": "metrics_page",
    "reference/families.md": "families_page",
}


def _renderer(module_name: str) -> Callable[[], str]:
    def render() -> str:
        return importlib.import_module(f"{__name__}.{module_name}").render()

    render.__name__ = f"render_{module_name}"
    return render


PAGES: dict[str, Callable[[], str]] = {path: _renderer(module) for path, module in _MODULES.items()}


def render_all() -> dict[str, str]:
    """Every page's Markdown, by site path."""
    return {path: render() for path, render in PAGES.items()}
