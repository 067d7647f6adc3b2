//! A no-op Envoy external processor: for every message Envoy sends on a stream (request headers,
//! request body, response headers, each response body chunk) it answers at once with the matching
//! empty response — "continue, change nothing". The load bench puts it beside sluice so the cost of
//! the external-processing architecture (a gRPC round trip per message, done by Envoy) is measured
//! on the same machine in the same run, with no work of its own.
//!
//! Usage: sluice-bench-extproc-noop 127.0.0.1:PORT

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, BodyResponse, HeadersResponse, ProcessingRequest, ProcessingResponse,
};
use futures_util::StreamExt;
use std::pin::Pin;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

struct NoOp;

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

fn answer(request: ProcessingRequest) -> Option<ProcessingResponse> {
    use processing_request::Request as In;
    use processing_response::Response as Out;
    let response = match request.request? {
        In::RequestHeaders(_) => Out::RequestHeaders(HeadersResponse::default()),
        In::ResponseHeaders(_) => Out::ResponseHeaders(HeadersResponse::default()),
        In::RequestBody(_) => Out::RequestBody(BodyResponse::default()),
        In::ResponseBody(_) => Out::ResponseBody(BodyResponse::default()),
        // Trailers are not sent in the bench's processing mode.
        _ => return None,
    };
    Some(ProcessingResponse { response: Some(response), ..Default::default() })
}

#[tonic::async_trait]
impl ExternalProcessor for NoOp {
    type ProcessStream = Answers;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Answers>, Status> {
        let answers = request.into_inner().filter_map(|message| async move {
            match message {
                Ok(m) => answer(m).map(Ok),
                Err(status) => Some(Err(status)),
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:18100".into()).parse()?;
    tonic::transport::Server::builder().add_service(ExternalProcessorServer::new(NoOp)).serve(addr).await?;
    Ok(())
}
