"""The old name of :mod:`labsupport.transformer` (the Llama-style decoder), kept so that notebooks
released before the module was renamed (``from labsupport.model import Transformer``) still run.
New code imports :mod:`labsupport.transformer`; model shapes are in :mod:`labsupport.models`."""

from .transformer import *  # noqa: F403
