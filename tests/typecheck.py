"""The runtime type checker the test suite runs tracekit under (pytest
``--jaxtyping-packages=tracekit,typecheck.typechecker``): beartype, with PEP 484's
implicit numeric tower (an ``int`` is accepted where a ``float`` is annotated), checking every
jaxtyping shape annotation (``Float[torch.Tensor, "batch pos d_model"]``) at each call."""

from beartype import BeartypeConf, beartype

typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))
