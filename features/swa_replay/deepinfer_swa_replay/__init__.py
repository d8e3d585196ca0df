"""SWA bounded replay: DeepSeek-V4.1's decoder layers prefill each prompt's last tokens only."""
