"""Makes the Triton interpreter patch `triton.language` once per kernel launch, not once per helper call.

The interpreter (triton 3.x) re-runs `_patch_lang` -- an `inspect.getmembers` scan of `tl`, `tl.tensor`
and `tl.math` -- on every call of a `@triton.jit` helper from inside a kernel, although the launch has
already patched those modules and re-patching them changes nothing (patched builtins are no longer
builtins; the other attributes are set to the same functions). Our kernels call helpers per tile, so
that scan was ~40% of an engine test's time (py-spy). Here a launch records which language modules it patched
and a helper call whose modules are all among them skips the scan. Anything else goes to the original.
If the interpreter's internals differ from what this expects, nothing is changed.
"""

import functools


def install() -> None:
    """Wraps the interpreter's launch and `_patch_lang` (once; a no-op on an unexpected triton)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None or getattr(patch_lang, "_once", False):
        return
    grid_call = executor.__call__
    launches: list[set[int]] = []  # per running launch: ids of the language modules it has patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    @functools.wraps(patch_lang)
    def patch_lang_once(fn):
        langs = languages(fn)
        if launches and langs and langs <= launches[-1]:
            return scope_type()  # already patched by this launch: nothing to do, nothing to restore
        scope = patch_lang(fn)
        if launches:
            launches[-1] |= langs
        return scope

    @functools.wraps(grid_call)
    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang_once._once = True
    interpreter._patch_lang = patch_lang_once
    executor.__call__ = launch
