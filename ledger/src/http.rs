//! The HTTP/1.1 front: routing, body limits, status codes.

use crate::api::{BadRequest, ChargeRequest, ReserveRequest, SettleBatch, SettleOutcome, SettleRequest, MAX_BODY_BYTES};
use crate::store::StoreError;
use crate::Ledger;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// How long a client may take to send a request's headers, then its body.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves until `shutdown` completes; connections already open finish on their own tasks.
pub async fn serve(listener: TcpListener, ledger: Arc<Ledger>, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: wait a little rather than spin.
                eprintln!("sluice-ledger: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let ledger = ledger.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let ledger = ledger.clone();
                async move { Ok::<_, Infallible>(handle(&ledger, request).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    respond(status, "application/json", body.to_string())
}

fn bad_request(e: &BadRequest) -> Response<Full<Bytes>> {
    json_response(StatusCode::BAD_REQUEST, &e.body())
}

/// A store failure's status, body and metric label.
fn store_failure_answer(e: &StoreError) -> (StatusCode, Value, &'static str) {
    match e {
        StoreError::Unavailable(m) => (StatusCode::SERVICE_UNAVAILABLE, json!({"error": "redis_unavailable", "message": m}), "unavailable"),
        StoreError::Script(m) => (StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "ledger_error", "message": m}), "error"),
    }
}

fn store_failure(e: &StoreError) -> (Response<Full<Bytes>>, &'static str) {
    let (status, body, label) = store_failure_answer(e);
    (json_response(status, &body), label)
}

/// The body, at most [`MAX_BODY_BYTES`], read within [`READ_TIMEOUT`].
async fn read_body(request: Request<Incoming>) -> Result<Bytes, BadRequest> {
    if let Some(ct) = request.headers().get(CONTENT_TYPE) {
        let essence = ct.to_str().unwrap_or("").split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if essence != "application/json" {
            return Err(BadRequest::new("unsupported_media_type", format!("content-type {ct:?}; application/json expected")));
        }
    }
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(BadRequest::new("body_too_large", format!("body larger than {MAX_BODY_BYTES} bytes")));
    }
    match tokio::time::timeout(READ_TIMEOUT, Limited::new(request.into_body(), MAX_BODY_BYTES).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(BadRequest::new("body_too_large", format!("body larger than {MAX_BODY_BYTES} bytes"))),
        Ok(Err(e)) => Err(BadRequest::new("malformed_body", e.to_string())),
        Err(_) => Err(BadRequest::new("malformed_body", "body not received in time")),
    }
}

/// Settles one valid request: the status and body `/v1/settle` answers, counted as a settle request.
async fn settle(ledger: &Ledger, request: &SettleRequest) -> (StatusCode, Value) {
    let (status, answer, label) = match ledger.store.settle(request).await {
        Ok(outcome @ SettleOutcome::Mismatch { .. }) => (StatusCode::BAD_REQUEST, outcome.body(), outcome.label()),
        Ok(outcome) => (StatusCode::OK, outcome.body(), outcome.label()),
        Err(e) => store_failure_answer(&e),
    };
    ledger.metrics.request("settle", label);
    (status, answer)
}

/// One item of a settlement batch: the status and body `/v1/settle` would have answered it with,
/// as `{"status": …, "answer": …}`.
async fn settle_one(ledger: &Ledger, item: &Result<SettleRequest, BadRequest>) -> Value {
    let (status, answer) = match item {
        Err(e) => {
            ledger.metrics.request("settle", "bad_request");
            (StatusCode::BAD_REQUEST, e.body())
        }
        Ok(request) => settle(ledger, request).await,
    };
    json!({"status": status.as_u16(), "answer": answer})
}

/// The body of a request to `endpoint`, read and validated by `parse`; a refusal is answered (400)
/// and counted as that endpoint's `bad_request`.
async fn body_of<T>(
    metrics: &crate::metrics::Metrics,
    endpoint: &str,
    request: Request<Incoming>,
    parse: fn(&[u8]) -> Result<T, BadRequest>,
) -> Result<T, Response<Full<Bytes>>> {
    let parsed = match read_body(request).await {
        Ok(body) => parse(&body),
        Err(e) => Err(e),
    };
    parsed.map_err(|e| {
        metrics.request(endpoint, "bad_request");
        bad_request(&e)
    })
}

/// A store call's answer to `endpoint`: 200 with the outcome's body, or the store's failure;
/// counted under the outcome's or the failure's label.
fn answered(metrics: &crate::metrics::Metrics, endpoint: &str, outcome: Result<(&'static str, Value), StoreError>) -> Response<Full<Bytes>> {
    match outcome {
        Ok((label, body)) => {
            metrics.request(endpoint, label);
            json_response(StatusCode::OK, &body)
        }
        Err(e) => {
            let (response, label) = store_failure(&e);
            metrics.request(endpoint, label);
            response
        }
    }
}

pub async fn handle(ledger: &Ledger, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let metrics = &ledger.metrics;
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    match (path.as_str(), method) {
        ("/v1/reserve", Method::POST) => {
            let request = match body_of(metrics, "reserve", request, ReserveRequest::parse).await {
                Ok(request) => request,
                Err(response) => return response,
            };
            answered(metrics, "reserve", ledger.store.reserve(&request).await.map(|outcome| (outcome.label(), outcome.body())))
        }
        ("/v1/settle", Method::POST) => {
            let request = match body_of(metrics, "settle", request, SettleRequest::parse).await {
                Ok(request) => request,
                Err(response) => return response,
            };
            let (status, answer) = settle(ledger, &request).await;
            json_response(status, &answer)
        }
        ("/v1/settle_batch", Method::POST) => {
            let batch = match body_of(metrics, "settle_batch", request, SettleBatch::parse).await {
                Ok(batch) => batch,
                Err(response) => return response,
            };
            // Every item at once: the Redis connection pipelines them (one script call each, so
            // each stays in its org's slot on a cluster).
            let results = futures_util::future::join_all(batch.items.iter().map(|item| settle_one(ledger, item))).await;
            metrics.request("settle_batch", "ok");
            json_response(StatusCode::OK, &json!({ "results": results }))
        }
        ("/v1/charge", Method::POST) => {
            let request = match body_of(metrics, "charge", request, ChargeRequest::parse).await {
                Ok(request) => request,
                Err(response) => return response,
            };
            answered(metrics, "charge", ledger.store.charge(&request).await.map(|outcome| (outcome.label(), outcome.body())))
        }
        ("/healthz", Method::GET) => match ledger.store.ping().await {
            Ok(()) => {
                metrics.request("healthz", "ok");
                respond(StatusCode::OK, "text/plain", "ok")
            }
            Err(_) => {
                metrics.request("healthz", "unavailable");
                respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "redis unavailable\n")
            }
        },
        ("/metrics", Method::GET) => {
            metrics.request("metrics", "ok");
            respond(StatusCode::OK, "text/plain; version=0.0.4", metrics.render())
        }
        ("/v1/reserve" | "/v1/settle" | "/v1/settle_batch" | "/v1/charge" | "/healthz" | "/metrics", _) => {
            metrics.request("other", "method_not_allowed");
            json_response(StatusCode::METHOD_NOT_ALLOWED, &json!({"error": "method_not_allowed", "message": format!("{path}: wrong method")}))
        }
        _ => {
            metrics.request("other", "not_found");
            json_response(StatusCode::NOT_FOUND, &json!({"error": "not_found", "message": format!("no endpoint {path}")}))
        }
    }
}
