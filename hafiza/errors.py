"""User-facing errors: each carries one clear line naming the problem (the CLI prints it, the server maps it to 400)."""


class HafizaError(Exception):
    """Base class for errors caused by the user's input or environment, never by a bug."""


class ModelLoadError(HafizaError):
    """The model file or directory is missing, corrupt, truncated or of an unsupported architecture."""


class RequestError(HafizaError):
    """A request that can never be served as given (too long, bad sampling parameters, ...).

    `param` names the request field at fault (a SamplingParams field such as "max_tokens", or "prompt"), so the
    server can fill its error's `param` without reading the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(HafizaError, ValueError):
    """An engine, store or server setting that cannot be read or cannot work (a bad size, a budget too small).

    `setting` names the configuration field at fault (an EngineConfig field such as "kv_memory"), so a front end
    can say which of its own options to change; the message itself names no command-line flag."""

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting
