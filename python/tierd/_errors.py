"""tierd's errors: every one a TierdError, carrying a gRPC status code.

A call the daemon or the client library refuses raises TierdError itself ("RESOURCE_EXHAUSTED:
..."). What tierd's Python refuses raises a subclass that is also the builtin a Python user
catches for it, and reads as its message alone, so an `except ValueError` written for
torch.optim.AdamW still catches OffloadedAdamW's "Invalid learning rate: -1":

    TierdError                        any of them; .code, .code_name, .message
      InvalidArgument (ValueError)    INVALID_ARGUMENT: a value, a file's contents, a layout
      InvalidType (TypeError)         INVALID_ARGUMENT: an object of the wrong kind
      NotFound (FileNotFoundError)    NOT_FOUND: a checkpoint or a file that is not there
      PermissionDenied (PermissionError)  PERMISSION_DENIED: a base made by an untrusted user
      FailedPrecondition (RuntimeError)   FAILED_PRECONDITION: a call at the wrong time
      MissingDependency (ImportError)     FAILED_PRECONDITION: a package or library to install
      ViewConsumed (BufferError)          FAILED_PRECONDITION: a DLPack view taken twice
      UnsafePickle (pickle.UnpicklingError)  PERMISSION_DENIED: a checkpoint naming code
"""
import enum
import pickle


class Status(enum.IntEnum):
    """tierd_status: the gRPC status codes."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class TierdError(Exception):
    """A refused call: `code` is the gRPC status code (an int), `code_name` its name
    ("RESOURCE_EXHAUSTED"), `message` the daemon's (or the client library's) words."""

    def __init__(self, code: int, message: str):
        self.code = int(code)
        try:
            self.code_name = Status(code).name
        except ValueError:
            self.code_name = str(code)
        self.message = message
        super().__init__(self._text())

    def _text(self) -> str:
        return f"{self.code_name}: {self.message}"

    def __reduce__(self):  # pickled whole, as a rank's error sent to the others is
        return type(self), (self.code, self.message), self.__dict__


class _Refusal(TierdError):
    """Raised by tierd's Python: the class names the code, and str() is the message."""
    CODE = Status.UNKNOWN

    def __init__(self, message: str):
        super().__init__(self.CODE, message)

    def _text(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message,), self.__dict__


class InvalidArgument(_Refusal, ValueError):
    CODE = Status.INVALID_ARGUMENT


class InvalidType(_Refusal, TypeError):
    CODE = Status.INVALID_ARGUMENT


class NotFound(_Refusal, FileNotFoundError):
    CODE = Status.NOT_FOUND


class PermissionDenied(_Refusal, PermissionError):
    CODE = Status.PERMISSION_DENIED


class FailedPrecondition(_Refusal, RuntimeError):
    CODE = Status.FAILED_PRECONDITION


class MissingDependency(_Refusal, ImportError):
    CODE = Status.FAILED_PRECONDITION


class ViewConsumed(_Refusal, BufferError):
    CODE = Status.FAILED_PRECONDITION


class UnsafePickle(_Refusal, pickle.UnpicklingError):
    CODE = Status.PERMISSION_DENIED
