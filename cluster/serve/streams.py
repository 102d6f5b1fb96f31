"""The reply stream of a streamed chat completion (cluster/serve/app.py)."""

from fastapi.responses import StreamingResponse


class EventStream(StreamingResponse):
    """A stream that takes Ray Serve's cancelled receive as the client's going away: when a client
    disconnects mid-stream, Serve may cancel the request's receive before the disconnect message
    arrives, and starlette would log that TaskCancelledError as a traceback."""

    async def listen_for_disconnect(self, receive) -> None:
        from ray.exceptions import TaskCancelledError

        try:
            await super().listen_for_disconnect(receive)
        except TaskCancelledError:
            return  # the same as http.disconnect: the caller cancels the stream
