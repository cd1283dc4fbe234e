"""The engine: the RoundPipe wrapper, dispatch, stage runs, the host state and the asynchronous step."""
