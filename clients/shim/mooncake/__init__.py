"""Opt-in shim: `import mooncake.store` answers with `tycho.store`.

Put `clients/shim` on PYTHONPATH to run a client written for Mooncake (LMCache, SGLang) on Tycho
without changing its code. It is never installed: a real `mooncake` package elsewhere on the path
stays untouched, and this directory only wins when it comes first on PYTHONPATH.
"""
