//! The composition root and the operator's side: [`server`] builds the node and its
//! services and runs them; [`control`] (signals, reload, check-config), [`admin`] (the Unix
//! admin socket) and [`logging`] act on a started server. Nothing below imports this layer.

pub mod admin;
pub mod control;
pub mod logging;
pub mod server;
