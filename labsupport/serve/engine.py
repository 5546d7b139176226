"""The old name of :mod:`labsupport.serve.fifo` (chapter 03's first-in, first-out back end), kept so
that notebooks released before the rename (``from labsupport.serve.engine import MODEL_NAME,
course_model_config``) still run. New code imports :mod:`labsupport.serve.fifo`, the shared parts
from :mod:`labsupport.serve.backend` and the model from :mod:`labsupport.serve.served_model`."""

from ..tokenizer import course_tokenizer  # noqa: F401
from .backend import (  # noqa: F401
    TIMELINES_KEPT,
    Backend,
    GenerationRequest,
    InvalidRequest,
    RequestHandle,
    Timeline,
    TokenOut,
    new_request_id,
)
from .fifo import FifoBackend, FifoEngine  # noqa: F401
from .served_model import BASE_PRESET, MODEL_NAME, WEIGHTS_NOTE, course_model_config  # noqa: F401
