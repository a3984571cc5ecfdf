"""Structured outputs: constrained decoding through xgrammar (JSON schema, regex, choice, EBNF grammar).

The engine keeps one grammar matcher per sequence (forked with the sequence), fills each step's
token bitmasks from them, and the sampler masks the logits with those bitmasks before anything
else, so greedy decoding, sampling, parallel samples and beam search all stay inside the grammar.
"""

from pagedllm.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
