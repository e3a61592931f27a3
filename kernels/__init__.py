"""specsplit.kernels: Triton and CPU kernels, each beside its torch reference and host wrapper.

This folder is installed and imported only as `specsplit.kernels` (specsplit/kernels links here).
Where the repository root itself is on sys.path (pytest's rootdir, `python -m ...` run from the
root), the folder would also answer to the bare name `kernels`, which is PyPI's package (current
transformers imports it). Imported under that name, this module hands the import over to the
real `kernels` from the rest of sys.path; where there is none it stays an empty module (what it
was before, and what an older transformers, which only looks for the name, expects).
"""
if __name__ == "kernels":  # not us: the bare name, found through the repository root
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # what `import kernels` returns once this file has run
        _spec.loader.exec_module(_module)
