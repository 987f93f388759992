"""kvproof engine: a Llama-family model over paged KV pools with ownership tags.

Importing the package imports nothing heavy; torch comes in with the modules that use it
(engine.model, engine.pool, ...), so the kvproof CLI starts fast for every other command.
engine/ imports kernels/ and never sim/, fuzz/ or api/.
"""
