//! RFC 6121 §3 and Appendix A: the subscription state machine as pure functions.
