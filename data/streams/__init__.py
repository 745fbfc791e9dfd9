"""What every datamodule shares: packed token windows, the seeded resumable sample stream, and the stream
position kept in checkpoints."""
