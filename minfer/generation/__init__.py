"""Decoding, model-agnostic: it drives any model implementing `protocol.DecodingModel`.

- protocol.py    what a model provides (token ids, batches, a decode state per request)
- options.py     the generation options, their checks and their precedence
- processors.py  logits processors and the sampler (pure, vectorised)
- search.py      greedy / sampled token loop and beam search
- prompts.py     what inputs may be; each prompt's checks; the tokenizer text input needs
- planning.py    which prompts share a batch (memory-aware), the windows a stream is read in
- streaming.py   a row's text as its tokens are decided, stop strings cut; one prompt's Stream
- text.py        the call: prompts in, text out; the public `generate`, `run`, `stream` and
                 `run_iter` (any number of prompts, bounded memory)
- batcher.py     continuous batching of requests that run at the same time
"""

from .options import BatchOptions, DEFAULT_MAX_NEW_TOKENS, GenerationOptions, resolve_options
from .protocol import DecodeState, DecodingModel, TokenIds
from .planning import BadRow, plan_batches
from .search import Hypothesis, beam_search, token_loop
from .streaming import StopMatcher, Stream, stream_tokens
from .text import Result, generate, run, run_iter, stream

__all__ = ["BatchOptions", "DEFAULT_MAX_NEW_TOKENS", "GenerationOptions", "resolve_options",
           "DecodeState", "DecodingModel", "TokenIds", "Hypothesis", "beam_search", "token_loop",
           "BadRow", "Result", "StopMatcher", "Stream", "generate", "plan_batches", "run", "run_iter",
           "stream", "stream_tokens"]
