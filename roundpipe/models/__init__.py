"""Models shipped with roundpipe, each expressed as a list of layers that RoundPipe cuts into stages.

`tiny_decoder`: the byte-level decoder-only transformer that `roundpipe train` trains.
`sleep`: layers whose compute is a sleep, for measuring the schedule itself (bench/overlap.py).
"""
