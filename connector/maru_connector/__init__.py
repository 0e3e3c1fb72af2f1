"""Maru data plane: the shared KV memory pool and the vLLM connector that uses it.

Importing this package must stay cheap and must not import vLLM or torch: the operator
imports ``maru_contracts.config`` to write the very configuration the connector parses.
"""
