"""What a model family's device and server sides must compute identically, pure and sans-IO."""
