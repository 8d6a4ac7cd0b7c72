//! Mutual TLS on the xDS port (`--tls-cert`, `--tls-key`, `--client-ca`): only an Envoy
//! whose client certificate the CA signed gets a stream, and its name in the ledger starts
//! with the identity in that certificate (a SPIFFE URI or a DNS name), not with what it says.
//!
//! The three files are read again when they change (cert-manager renews a Secret in place):
//! each new connection is accepted with the files as they were at its handshake, and the
//! streams already open keep their TLS session. A change that does not load (a half-written
//! key, a certificate without its key) is logged and the previous files stay in use.
//!
//! Not here: the gRPC service (crate::xds); what a node is called without TLS (its node id).

use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use x509_parser::extensions::GeneralName;

/// How long a client has for its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How often the files are looked at.
const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// The command line's TLS options (all three, or none: then xDS is plain gRPC).
#[derive(clap::Args, Debug, Clone)]
pub struct TlsArgs {
    /// The xDS server's certificate chain (PEM), e.g. a cert-manager Secret's tls.crt.
    /// With --tls-key and --client-ca: Envoys must connect with mutual TLS.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "client_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The server certificate's private key (PEM), e.g. tls.key.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "client_ca"])]
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) an Envoy's client certificate must chain to, e.g. ca.crt.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub client_ca: Option<PathBuf>,
}

/// Who is at the other end of an xDS connection (a request extension, through tonic's
/// `Connected`).
#[derive(Clone, Debug)]
pub struct Peer {
    /// The certificate's first SPIFFE URI, else its first URI, else its first DNS name.
    pub identity: String,
}

/// The ledger's name for a node: with mutual TLS, the certificate's identity and then the
/// node id the Envoy gave (so that the replicas sharing one certificate stay apart, and no
/// Envoy can take another identity's name); without, the node id alone.
pub fn node_name(peer: Option<&Peer>, claimed: Option<&str>) -> String {
    match (peer, claimed) {
        (Some(peer), Some(claimed)) => format!("{}#{}", peer.identity, claimed.replace('#', "_")),
        (Some(peer), None) => peer.identity.clone(),
        (None, Some(claimed)) => claimed.to_owned(),
        (None, None) => "(no node id)".to_owned(),
    }
}

#[derive(Clone, Debug)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    client_ca: PathBuf,
}

impl Files {
    fn read(&self) -> Result<[Vec<u8>; 3], String> {
        let read = |flag: &str, path: &PathBuf| {
            std::fs::read(path).map_err(|e| format!("{flag} {}: {e}", path.display()))
        };
        Ok([
            read("--tls-cert", &self.cert)?,
            read("--tls-key", &self.key)?,
            read("--client-ca", &self.client_ca)?,
        ])
    }
}

/// The acceptor of the files as last loaded; swapped when they change.
#[derive(Clone)]
pub struct Acceptor {
    current: Arc<RwLock<TlsAcceptor>>,
}

impl Acceptor {
    fn get(&self) -> TlsAcceptor {
        match self.current.read() {
            Ok(acceptor) => acceptor.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, acceptor: TlsAcceptor) {
        match self.current.write() {
            Ok(mut current) => *current = acceptor,
            Err(poisoned) => *poisoned.into_inner() = acceptor,
        }
    }
}

impl TlsArgs {
    /// Load the files (an error names the flag), and keep them loaded: a task re-reads them
    /// when they change. None without TLS options.
    pub fn acceptor(&self) -> Result<Option<Acceptor>, String> {
        let (Some(cert), Some(key), Some(client_ca)) =
            (&self.tls_cert, &self.tls_key, &self.client_ca)
        else {
            return Ok(None);
        };
        let files = Files {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: client_ca.clone(),
        };
        let bytes = files.read()?;
        let config = server_config(&bytes)?;
        let acceptor = Acceptor {
            current: Arc::new(RwLock::new(TlsAcceptor::from(Arc::new(config)))),
        };
        log::info!(
            "xDS over mutual TLS: clients must show a certificate from {}",
            client_ca.display()
        );
        tokio::spawn(reload(files, bytes, acceptor.clone()));
        Ok(Some(acceptor))
    }
}

/// Look at the files every [`RELOAD_EVERY`]; load them when their bytes changed.
async fn reload(files: Files, mut last: [Vec<u8>; 3], acceptor: Acceptor) {
    loop {
        tokio::time::sleep(RELOAD_EVERY).await;
        let bytes = match files.read() {
            Ok(bytes) if bytes != last => bytes,
            Ok(_) => continue,
            Err(e) => {
                log::warn!("TLS files not reloaded: {e}");
                continue;
            }
        };
        match server_config(&bytes) {
            Ok(config) => {
                acceptor.set(TlsAcceptor::from(Arc::new(config)));
                log::info!("TLS files reloaded: new connections use them");
            }
            Err(e) => log::warn!("TLS files changed but do not load, the previous stay: {e}"),
        }
        last = bytes;
    }
}

/// The server's rustls configuration: its certificate, client certificates required and
/// checked against the CA, HTTP/2 only.
fn server_config([cert, key, ca]: &[Vec<u8>; 3]) -> Result<ServerConfig, String> {
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--tls-cert: not PEM certificates: {e}"))?;
    if chain.is_empty() {
        return Err("--tls-cert: no certificate in the file".to_owned());
    }
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| format!("--tls-key: not a PEM private key: {e}"))?;
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca) {
        let ca = ca.map_err(|e| format!("--client-ca: not PEM certificates: {e}"))?;
        roots
            .add(ca)
            .map_err(|e| format!("--client-ca: not a CA certificate: {e}"))?;
    }
    if roots.is_empty() {
        return Err("--client-ca: no certificate in the file".to_owned());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| format!("--client-ca: {e}"))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| format!("--tls-cert and --tls-key: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The identity a client certificate (DER) names: its first SPIFFE URI, else its first URI,
/// else its first DNS name.
pub fn identity_of(der: &[u8]) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the client certificate does not parse: {e}"))?;
    let names = cert
        .subject_alternative_name()
        .map_err(|e| format!("the client certificate's subjectAltName: {e}"))?
        .map(|san| san.value.general_names.clone())
        .unwrap_or_default();
    let uris: Vec<&str> = names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(uri) => Some(*uri),
            _ => None,
        })
        .collect();
    let dns = names.iter().find_map(|n| match n {
        GeneralName::DNSName(name) => Some(*name),
        _ => None,
    });
    uris.iter()
        .find(|u| u.starts_with("spiffe://"))
        .or(uris.first())
        .copied()
        .or(dns)
        .map(str::to_owned)
        .ok_or_else(|| {
            "the client certificate names no URI or DNS subjectAltName: no identity".to_owned()
        })
}

/// An accepted, authenticated xDS connection.
pub struct Conn {
    stream: TlsStream<TcpStream>,
    peer: Peer,
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The connections of `listener` that complete a mutual TLS handshake, each shaken hands
/// on its own task (a slow client holds up no other). A refused one is logged with why.
pub fn incoming(listener: TcpListener, acceptor: Acceptor) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        while !tx.is_closed() {
            let (tcp, addr) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    log::warn!("xDS accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (tls, tx) = (acceptor.get(), tx.clone());
            tokio::spawn(async move {
                match handshake(tls, tcp).await {
                    Ok(conn) => {
                        log::debug!("{addr}: TLS from {}", conn.peer.identity);
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Err(e) => log::warn!("xDS connection from {addr} refused: {e}"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

async fn handshake(tls: TlsAcceptor, tcp: TcpStream) -> Result<Conn, String> {
    let stream = tokio::time::timeout(HANDSHAKE, tls.accept(tcp))
        .await
        .map_err(|_| format!("no TLS handshake within {} s", HANDSHAKE.as_secs()))?
        .map_err(|e| format!("TLS: {e}"))?;
    let der = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .ok_or("no client certificate")?;
    let identity = identity_of(der)?;
    Ok(Conn {
        stream,
        peer: Peer { identity },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_named_by_its_certificate_first() {
        let peer = Peer {
            identity: "spiffe://cluster.local/ns/fanout/sa/fanout".to_owned(),
        };
        let cases = [
            (
                Some(&peer),
                Some("fanout-0"),
                "spiffe://cluster.local/ns/fanout/sa/fanout#fanout-0",
            ),
            (
                Some(&peer),
                Some("a#b"),
                "spiffe://cluster.local/ns/fanout/sa/fanout#a_b",
            ),
            (
                Some(&peer),
                None,
                "spiffe://cluster.local/ns/fanout/sa/fanout",
            ),
            (None, Some("fanout-0"), "fanout-0"),
            (None, None, "(no node id)"),
        ];
        for (peer, claimed, want) in cases {
            assert_eq!(node_name(peer, claimed), want, "{claimed:?}");
        }
    }

    #[test]
    fn files_that_are_not_pem_are_refused_naming_the_flag() {
        let err = server_config(&[b"x".to_vec(), b"y".to_vec(), b"z".to_vec()]).unwrap_err();
        assert!(err.starts_with("--tls-cert"), "{err}");
    }

    /// A certificate's DER (test certificates made with the openssl CLI).
    fn der(pem: &str) -> Vec<u8> {
        CertificateDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .to_vec()
    }

    /// subjectAltName=DNS:fanout.fanout.svc,DNS:other.example
    const DNS_ONLY: &str = "-----BEGIN CERTIFICATE-----\nMIIBnjCCAUOgAwIBAgIUfl8zqnWeAAJNkWdBVanPtb1U1hIwCgYIKoZIzj0EAwIw\nDTELMAkGA1UEAwwCY2EwIBcNMjYxMjA2MDQxNjEzWhgPMjEyNjExMTIwNDE2MTNa\nMBIxEDAOBgNVBAMMB2Ruc29ubHkwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAARl\nuDzvW+152p9t5sATl9FVNQPsU0DwE8cNHp0DtQRUqXU9MNVl7SnnLptHvTLhS3H1\nyluXawN52m69g+dNZrGeo3oweDAJBgNVHRMEAjAAMCsGA1UdEQQkMCKCEWZhbm91\ndC5mYW5vdXQuc3Zjgg1vdGhlci5leGFtcGxlMB0GA1UdDgQWBBQVjYwTrTsPa1Xb\nCR7KA2jey+BCLTAfBgNVHSMEGDAWgBSkNFxYpN6f7Q9VP2Uzdpsz+bGy7zAKBggq\nhkjOPQQDAgNJADBGAiEA5Sg2GlmZUUg4aUVNyjNWSRiLcRzjOHMSu1ss8NIrsscC\nIQDineFeDZyOgdBt6O1Ikh+SV1Vqk8E2QvUREIKKMm5GAw==\n-----END CERTIFICATE-----\n";
    /// subjectAltName=DNS:fanout.fanout.svc,URI:https://example.com/x,URI:spiffe://cluster.local/ns/a/sa/b
    const URIS: &str = "-----BEGIN CERTIFICATE-----\nMIIByjCCAXCgAwIBAgIUfl8zqnWeAAJNkWdBVanPtb1U1hMwCgYIKoZIzj0EAwIw\nDTELMAkGA1UEAwwCY2EwIBcNMjYxMjA2MDQxNjE0WhgPMjEyNjExMTIwNDE2MTRa\nMBMxETAPBgNVBAMMCHVyaWZpcnN0MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n/oKK0zkrgEyrjurX5jEFVKsr8oD62pZ2sKWycMJf9UElwoJ3PqNo0Uuorfkz29H5\nJJzS3lFzmrc1OowBExoAHqOBpTCBojAJBgNVHRMEAjAAMFUGA1UdEQROMEyCEWZh\nbm91dC5mYW5vdXQuc3ZjhhVodHRwczovL2V4YW1wbGUuY29tL3iGIHNwaWZmZTov\nL2NsdXN0ZXIubG9jYWwvbnMvYS9zYS9iMB0GA1UdDgQWBBRkAzwviMlURJPlHnQh\nPqA6//EhQzAfBgNVHSMEGDAWgBSkNFxYpN6f7Q9VP2Uzdpsz+bGy7zAKBggqhkjO\nPQQDAgNIADBFAiEA/hlUxIqMs+ueqP1soidLAl08CBW85zn22HTey93ODJMCIF8x\nW+jBYjSvGQC/fx6vcdlm/F/Ob+NMw9HRfTGCH1gT\n-----END CERTIFICATE-----\n";
    /// No subjectAltName.
    const NO_NAMES: &str = "-----BEGIN CERTIFICATE-----\nMIIBbDCCAROgAwIBAgIUfl8zqnWeAAJNkWdBVanPtb1U1hQwCgYIKoZIzj0EAwIw\nDTELMAkGA1UEAwwCY2EwIBcNMjYxMjA2MDQxNjE0WhgPMjEyNjExMTIwNDE2MTRa\nMA8xDTALBgNVBAMMBG5vbmUwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAARzEUSY\nOdEBaW4IgVy1imITaFW4gYaBmLLutVqHyVSSzYLhPR7SsRtmevgf7/i6/Yae1YKU\nIfK745/fktE6fFddo00wSzAJBgNVHRMEAjAAMB0GA1UdDgQWBBSWtLlL85n26UD/\nnRZ5EgwiQkkOPDAfBgNVHSMEGDAWgBSkNFxYpN6f7Q9VP2Uzdpsz+bGy7zAKBggq\nhkjOPQQDAgNHADBEAiAvvdXGfG701AaarWgX587mj3wTddK0Z/UQfyu/thmGsAIg\nOqNPYrRfXlqU7aPQJP8NphhRiMwvW3rkikgHg2dDsBI=\n-----END CERTIFICATE-----\n";

    #[test]
    fn a_certificate_names_its_spiffe_uri_else_its_dns_name_else_nothing() {
        assert_eq!(
            identity_of(&der(URIS)).unwrap(),
            "spiffe://cluster.local/ns/a/sa/b"
        );
        assert_eq!(identity_of(&der(DNS_ONLY)).unwrap(), "fanout.fanout.svc");
        let err = identity_of(&der(NO_NAMES)).unwrap_err();
        assert!(err.contains("no identity"), "{err}");
        assert!(identity_of(b"not DER").is_err());
    }
}
