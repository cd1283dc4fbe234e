"""Models shipped with roundpipe, each expressed as a list of layers that RoundPipe cuts into stages.

`tiny_decoder`: the byte-level decoder-only transformer that `roundpipe train` trains.
"""
