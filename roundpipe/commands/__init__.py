"""The `roundpipe` command line: the router, the doctor and the built-in training job."""
