//! `fanout-control`: the control plane of fanout. Every fanout Envoy connects to it over ADS
//! (`envoy/xds/envoy.yaml`) and gets the fanout filter's configuration and who may send
//! (ECDS) and the subscriber clusters (CDS) from its source of truth; an HTTP endpoint says what each
//! Envoy has. See docs/control-plane.md.

mod cli;
mod clusters;
mod contract;
mod http;
mod knative;
mod kubernetes;
mod metrics;
mod model;
mod render;
mod render_files;
mod resource;
mod resource_json;
mod senders;
mod source;
mod state;
mod tls;
mod xds;

use clap::{CommandFactory, FromArgMatches, Parser};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use model::MapOptions;
use render::{RenderOptions, Served};
use source::Source;
use state::Ledger;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use tokio::sync::watch;

/// Serve fanout's configuration to Envoys over xDS (ADS: ECDS for the filter, CDS for the
/// subscriber clusters), from a directory of Knative objects.
#[derive(Parser, Debug)]
#[command(
    name = "fanout-control",
    version,
    after_help = "`fanout-control render --source dir:PATH --out DIR [...]` writes the same \
                  configuration to files instead (see `fanout-control render --help`)."
)]
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
    /// How long a subscriber's cluster stays on an Envoy after its filter stopped calling it,
    /// so that events already in flight finish their calls (and retries) to it.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    cluster_grace: u64,
    #[command(flatten)]
    config: cli::ConfigArgs,
    #[command(flatten)]
    tls: tls::TlsArgs,
    /// Forget an Envoy (its record in /state and its metrics) once it has had no stream for
    /// this long.
    #[arg(long, value_name = "SECONDS", default_value_t = 3600)]
    forget_after: u64,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    if std::env::args_os().nth(1).is_some_and(|a| a == "render") {
        return render_files::main(std::env::args_os().skip(1));
    }
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(message) = args.config.mismatch(&matches) {
        Args::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit();
    }
    let map_options = args.config.map_options();
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
    let options = args.config.render_options();
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
    let tls = args.tls.acceptor()?;
    tokio::spawn(forget_gone(
        ledger.clone(),
        std::time::Duration::from_secs(args.forget_after),
    ));
    let router = tonic::transport::Server::builder().add_service(ads);
    let grpc = async move {
        match tls {
            Some(tls) => {
                let incoming = tls::incoming(xds, tls);
                router
                    .serve_with_incoming_shutdown(incoming, stopped())
                    .await
            }
            None => {
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(xds);
                router
                    .serve_with_incoming_shutdown(incoming, stopped())
                    .await
            }
        }
    };
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
        let started = std::time::Instant::now();
        let served = Arc::new(render::serve(&snapshot, previous.as_deref(), &options));
        log::info!(
            "serving filter version {}, clusters version {} (decided in {:?})",
            served.ecds_version,
            served.cds_version,
            started.elapsed()
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

/// Every minute, forget the Envoys gone for longer than `after` (`--forget-after`): a node
/// id seen once does not stay in the ledger, `/state` and the metrics for ever.
async fn forget_gone(ledger: Ledger, after: std::time::Duration) {
    let every = after.min(std::time::Duration::from_secs(60));
    loop {
        tokio::time::sleep(every).await;
        for node in ledger.forget(after) {
            log::info!(
                "{node}: forgotten, gone for more than {} s",
                after.as_secs()
            );
            crate::metrics::forget(&node);
        }
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
