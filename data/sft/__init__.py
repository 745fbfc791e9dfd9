"""SFT data: conversations encoded with the prompt masked, packed into rows, and the SFT datamodule."""
