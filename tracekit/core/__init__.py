"""The ground floor: small ideas every other part of tracekit uses, each written once, importing
nothing else of tracekit (tests/unit/test_layers.py checks it).

* :mod:`~tracekit.core.errors` -- the one error root (``TracekitError`` and its subclasses);
* :mod:`~tracekit.core.strict` -- the strict pydantic base of every config class, with the one
  "retired field / value" mechanism, and the shared field types (prompts, index lists);
* :mod:`~tracekit.core.paths` -- YAML field paths (``experiments[0].target``): parse, format, get, set;
* :mod:`~tracekit.core.io` -- atomic writes, JSON-able values, file manifests (sizes + sha256);
* :mod:`~tracekit.core.signals` -- the one stack of SIGINT/SIGTERM handlers;
* :mod:`~tracekit.core.sites` -- the activation sites (site name -> hook-name template and index
  axes) and the layer / head / neuron checks every method calls.
"""
