"""DeepSeek-V4: hybrid sliding / compressed sparse / heavily compressed attention, mHC and MoE."""
