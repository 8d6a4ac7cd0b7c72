//! `fanout-control`: the control plane of fanout. Every fanout Envoy connects to it over ADS
//! (`envoy/xds/envoy.yaml`) and gets the fanout filter's configuration and who may send
//! (ECDS) and the subscriber clusters (CDS) from its source of truth; an HTTP endpoint says what each
//! Envoy has. See docs/control-plane.md.

mod http;
mod knative;
mod kubernetes;
mod model;
mod render;
mod senders;
mod source;
mod state;
mod xds;

use clap::Parser;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use model::{AuthorizationMode, MapOptions};
use render::{RenderOptions, Resolve, Served};
use source::Source;
use state::Ledger;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use tokio::sync::watch;

/// Serve fanout's configuration to Envoys over xDS (ADS: ECDS for the filter, CDS for the
/// subscriber clusters), from a directory of Knative objects.
#[derive(Parser, Debug)]
#[command(name = "fanout-control", version)]
struct Args {
    /// The source of truth. `dir:PATH`: a directory of Knative Channels, InMemoryChannels and
    /// Subscriptions as `kubectl get -o yaml` (or `-o json`) writes them, re-read when a
    /// file changes.
    /// `kubernetes`: FanoutChannels and Knative's InMemoryChannels, Channels, Subscriptions
    /// and EventPolicies, watched on the Kubernetes API (in-cluster configuration, or
    /// KUBECONFIG).
    #[arg(long, value_name = "dir:PATH|kubernetes")]
    source: String,
    /// With `--source kubernetes`: watch this namespace only (all namespaces by default).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,
    /// With `--source kubernetes`: the coordination.k8s.io Lease whose holder writes the
    /// FanoutChannels' status (every replica serves xDS; one writes).
    #[arg(long, value_name = "NS/NAME", default_value = "default/fanout-control", value_parser = kubernetes::namespaced)]
    lease: (String, String),
    /// With `--source kubernetes`: the Service of the fanout Envoys; each FanoutChannel gets
    /// a Service `<name>-kn-channel` in its namespace, an ExternalName to it.
    #[arg(long, value_name = "NS/NAME", value_parser = kubernetes::namespaced)]
    dispatcher_service: Option<(String, String)>,
    /// Where Envoys connect (gRPC, ADS); what envoy/xds/envoy.yaml points at.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:18000")]
    xds_address: SocketAddr,
    /// The state endpoint: GET /state (JSON: each channel, each Envoy's versions, NACKs with
    /// Envoy's text, which subscribers are live where) and GET /ready (200 once the source has
    /// been read).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:18001")]
    http_address: SocketAddr,
    /// fanout.wasm as the Envoys see it (a local file on their machine).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/etc/fanout-wasm/fanout.wasm"
    )]
    wasm: String,
    /// The CA bundle an https subscriber's certificate is checked against when the source
    /// names no CA certificates for it, as the Envoys see it.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/ssl/certs/ca-certificates.crt"
    )]
    trusted_ca: String,
    /// How long a subscriber's cluster stays on an Envoy after its filter stopped calling it,
    /// so that events already in flight finish their calls (and retries) to it.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    cluster_grace: u64,
    /// Check senders' OIDC tokens from this issuer and enforce the EventPolicies (Knative's
    /// OIDC authentication): served over ECDS as the `senders-jwt` and `senders-rbac`
    /// filters that envoy/xds/envoy.yaml runs before fanout. Without it, those let every
    /// request through and a channel in a namespace with an EventPolicy is reported and
    /// kept as it was.
    #[arg(long, value_name = "URL")]
    oidc_issuer: Option<String>,
    /// The issuer's JWKS as the Envoys see it (with --oidc-issuer).
    #[arg(long, value_name = "FILE", default_value = "/etc/fanout/jwks.json")]
    jwks: String,
    /// Who may send to a channel no EventPolicy applies to (with --oidc-issuer): Knative's
    /// default-authorization-mode, same words, same default.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = AuthorizationMode::AllowSameNamespace)]
    default_authorization_mode: AuthorizationMode,
    /// Reach HOST (on PORT only, when given) at ADDRESS:PORT instead of its DNS name
    /// (repeatable); calls keep the URI's authority, and https its SNI and certificate
    /// check on HOST.
    #[arg(long, value_name = "HOST[:PORT]=ADDRESS:PORT")]
    resolve: Vec<Resolve>,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let map_options = MapOptions {
        senders: args
            .oidc_issuer
            .as_ref()
            .map(|_| args.default_authorization_mode),
    };
    let source = match args.source.as_str() {
        "kubernetes" => {
            Ok(Box::new(kubernetes::KubeSource::new(args.namespace.clone())) as Box<dyn Source>)
        }
        _ => source::from_arg(&args.source),
    };
    let source = match source {
        Ok(source) => source,
        Err(e) => {
            eprintln!("fanout-control: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("fanout-control: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args, source, map_options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fanout-control: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args, source: Box<dyn Source>, map: MapOptions) -> Result<(), String> {
    let options = RenderOptions {
        wasm: args.wasm.clone(),
        trusted_ca: args.trusted_ca.clone(),
        oidc: args.oidc_issuer.clone().map(|issuer| senders::Oidc {
            issuer,
            jwks: args.jwks.clone(),
        }),
        resolve: args.resolve.clone(),
    };
    let ledger = Ledger::default();
    let (snapshots_tx, snapshots) = watch::channel(None);
    let (served_tx, served) = watch::channel(None);
    log::info!("source {}", source.describe());
    if args.source == "kubernetes" {
        tokio::spawn(write_status(
            args.clone_status(map),
            ledger.clone(),
            served.clone(),
        ));
    }
    tokio::spawn(source::run(source, map, snapshots_tx));
    tokio::spawn(decide(snapshots, served_tx, ledger.clone(), options));
    let xds = tokio::net::TcpListener::bind(args.xds_address)
        .await
        .map_err(|e| format!("cannot listen on --xds-address {}: {e}", args.xds_address))?;
    let http = tokio::net::TcpListener::bind(args.http_address)
        .await
        .map_err(|e| format!("cannot listen on --http-address {}: {e}", args.http_address))?;
    log::info!(
        "xDS (ADS) on {}, state on http://{}/state",
        args.xds_address,
        args.http_address
    );
    let ads = AggregatedDiscoveryServiceServer::new(xds::Ads {
        served,
        ledger: ledger.clone(),
        cluster_grace: std::time::Duration::from_secs(args.cluster_grace),
    });
    let grpc = tonic::transport::Server::builder()
        .add_service(ads)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(xds),
            stopped(),
        );
    tokio::select! {
        result = grpc => result.map_err(|e| format!("xDS server: {e}")),
        result = http::serve(http, ledger) => result,
    }
}

/// Each new snapshot -> what to serve (a channel with problems keeps its last good version).
async fn decide(
    mut snapshots: watch::Receiver<Option<Arc<model::Snapshot>>>,
    served_tx: watch::Sender<Option<Arc<Served>>>,
    ledger: Ledger,
    options: RenderOptions,
) {
    let mut previous: Option<Arc<Served>> = None;
    while snapshots.changed().await.is_ok() {
        let Some(snapshot) = snapshots.borrow_and_update().clone() else {
            continue;
        };
        let served = Arc::new(render::serve(&snapshot, previous.as_deref(), &options));
        log::info!(
            "serving filter version {}, clusters version {}",
            served.ecds_version,
            served.cds_version
        );
        ledger.serving(served.clone());
        previous = Some(served.clone());
        if served_tx.send(Some(served)).is_err() {
            return;
        }
    }
}

/// With `--source kubernetes`: the FanoutChannels' status, written by the Lease's holder.
async fn write_status(
    (namespace, lease, dispatcher, options): StatusArgs,
    ledger: Ledger,
    served: watch::Receiver<Option<Arc<Served>>>,
) {
    match kube::Client::try_default().await {
        Ok(client) => {
            let writer = kubernetes::Writer {
                client,
                namespace,
                lease,
                dispatcher,
                options,
            };
            writer.run(ledger, served).await;
        }
        Err(e) => log::error!("status writer: no Kubernetes configuration: {e}"),
    }
}

type StatusArgs = (
    Option<String>,
    (String, String),
    Option<(String, String)>,
    MapOptions,
);

impl Args {
    fn clone_status(&self, options: MapOptions) -> StatusArgs {
        (
            self.namespace.clone(),
            self.lease.clone(),
            self.dispatcher_service.clone(),
            options,
        )
    }
}

async fn stopped() {
    let interrupt = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => tokio::select! { _ = interrupt => {}, _ = term.recv() => {} },
        Err(_) => {
            let _ = interrupt.await;
        }
    }
    log::info!("stopping");
}
