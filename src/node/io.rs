//! The bytes under every XML stream, whatever carries them: TCP, TLS over TCP, the
//! WebSocket adapter, or a test duplex. It is the node's type rather than the transports'
//! because a stream-management session outlives its transport: the node keeps a detached
//! session's stream halves ([`crate::node::stream_management`]) until a new connection resumes it.

/// Anything a stream can run over.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A boxed transport, so STARTTLS can wrap whatever was there before.
pub type BoxIo = Box<dyn Io>;
