"""Every registered family. Importing this package registers them all (once)."""

from . import general  # noqa: F401
from . import alpaca_like, chatml_like, deepseek, glm, harmony, llama2_zh, phi, role_markers  # noqa: F401
from . import gemma, llama, mistral, qwen  # noqa: F401
