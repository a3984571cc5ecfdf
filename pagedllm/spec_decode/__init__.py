"""Speculative decoding: proposers of draft tokens and the bookkeeping that decides when to use them."""

from pagedllm.spec_decode.speculator import Speculator

__all__ = ["Speculator"]
