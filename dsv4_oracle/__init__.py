"""dsv4-oracle: a float64 oracle and conformance suite for DeepSeek-V4 sparse attention.

One import root holds everything that installs:

- :mod:`dsv4_oracle.reference`: the float64 oracle (the executable form of ``docs/contract.md``);
- :mod:`dsv4_oracle.gpu_impl`: the implementations (portable torch backend, cuDNN/Triton backend);
- :mod:`dsv4_oracle.fixtures`: named cases and the stored regression corpus;
- :mod:`dsv4_oracle.examples`: a worked adapter;
- the ``dsv4-oracle`` command, the comparison engine and the pytest plugin (this package).

In an installed wheel the sub-packages live inside this package. In a source checkout they are
the top-level folders ``reference/``, ``gpu_impl/``, ``fixtures/`` and ``examples/`` beside this
one (the repository's layout); the lines below make them importable under this root from there
too, so code always imports ``dsv4_oracle.reference`` and never a top-level ``reference``.
"""
import os as _os

__version__ = "0.2.0"

_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if (not _os.path.isdir(_os.path.join(_here, "reference"))
        and _os.path.isfile(_os.path.join(_checkout, "reference", "__init__.py"))):
    __path__.append(_checkout)      # a source checkout: the sub-packages sit beside this folder
