"""MkDocs hook adding the generated reference pages to the site (``hooks:`` in mkdocs.yml).

The pages exist only in the build: each is a generated File at its site path, so nothing under
docs/ can go stale. The only module of the package that imports mkdocs.
"""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files

from pagedllm.reference_pages import render_all


def on_files(files: Files, config: Any) -> Files:
    for path, markdown in render_all().items():
        files.append(File.generated(config, path, content=markdown))
    return files
