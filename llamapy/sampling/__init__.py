"""Sampler chains (llama.cpp's llama-sampling): CPU samplers over candidate arrays, and their
backend forms, ops appended to the model graph so only the chosen token leaves it; GBNF
grammars and JSON schemas (llama-grammar, json-schema-to-grammar) as a constraint on a chain."""
from .grammar import Grammar, GrammarError, GrammarMatcher, compile_grammar
from .grammar_sampler import GrammarChain, GrammarConstraint, GrammarTrigger, constrain
from .json_schema_grammar import json_schema_to_grammar
from .rng import DEFAULT_SEED, StdRng
from .samplers import (
                       Candidates,
                       Dist,
                       Greedy,
                       LogitBias,
                       MinP,
                       Penalties,
                       Sampler,
                       SamplerChain,
                       Temp,
                       TempExt,
                       TopK,
                       TopP,
                       Typical,
                       default_chain,
)

__all__ = ["Candidates", "DEFAULT_SEED", "Dist", "Grammar", "GrammarChain", "GrammarConstraint", "GrammarError",
           "GrammarMatcher", "GrammarTrigger", "Greedy", "LogitBias", "MinP", "Penalties", "Sampler", "SamplerChain",
           "StdRng", "Temp", "TempExt", "TopK", "TopP", "Typical", "compile_grammar", "constrain", "default_chain",
           "json_schema_to_grammar"]
