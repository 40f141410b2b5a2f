"""What the daemon needs of the machine it runs on, below every other room: file and directory
modes (``fsmodes``), sockets claimed and malloc tuned (``process``), structured logging
(``logs``), and the asyncio helpers the loops share (``aio``). Nothing here imports the rest of
kvcached."""
