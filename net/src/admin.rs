//! The standard gRPC admin services every Keel server exposes beside its own: the health
//! service (`grpc.health.v1.Health`, what Kubernetes' `grpc:` probes and `grpc_health_probe`
//! call) and server reflection (`grpc.reflection.v1`, so `grpcurl list` works without the
//! .proto files).

use tonic::server::NamedService;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};

/// Reflection could not be built from the embedded descriptors.
#[derive(Debug, thiserror::Error)]
#[error("gRPC reflection: {0}")]
pub struct AdminError(#[from] tonic_reflection::server::Error);

/// The health and reflection services for a server whose main service is `S`.
///
/// Health reports SERVING for `S` and for the whole server (the empty service name) from the
/// start; keep the returned [`HealthReporter`] to report NOT_SERVING while shutting down.
///
/// # Errors
/// [`AdminError`] if the embedded descriptor sets do not decode (a build defect).
pub async fn admin_services<S: NamedService>() -> Result<
    (
        HealthReporter,
        HealthServer<impl Health>,
        ServerReflectionServer<impl ServerReflection>,
    ),
    AdminError,
> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<S>().await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(keel_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    Ok((reporter, health, reflection))
}

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM (systemd, Kubernetes, `docker stop`,
/// Slurm), logging which; servers pass it as their shutdown future so that they stop
/// gracefully. If a signal handler cannot be installed, that signal is simply not awaited.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
                    _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                }
            }
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM ({e}); only Ctrl-C stops this process");
                let _ = tokio::signal::ctrl_c().await;
                tracing::info!("SIGINT: shutting down");
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("Ctrl-C: shutting down");
    }
}

/// Reports the whole server (the empty service name) NOT_SERVING: called when shutdown
/// begins, so that load balancers and probes stop sending new work before the port closes.
pub async fn mark_not_serving(reporter: &HealthReporter) {
    reporter
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
}
