"""What every package shares and nothing in it depends on: errors, sizes, devices and precision,
the hardware table, the console, checkpoint I/O and the metrics record. It takes plain data
(paths, dicts, tensors), never configs or models, so that it can sit below all of them."""
