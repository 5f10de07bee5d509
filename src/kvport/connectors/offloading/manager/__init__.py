"""The host tier's slot manager (scheduler side): which key holds which host slot, eviction
policies (LRU, ARC) and admission control."""
