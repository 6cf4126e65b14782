"""Tycho: a distributed KV-cache store for LLM inference.

``tycho.store`` is a drop-in for ``mooncake.store``: change the import, keep the code.
"""
