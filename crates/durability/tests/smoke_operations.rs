mod support;

use std::time::Duration;

use durability::{DurableCall, HandlerError, OperationResult, Operations, Scheduler};

#[tokio::test(start_paused = true)]
async fn an_operation_runs_and_its_result_is_readable() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        h.install(&scheduler);
        let ops = Operations::builder(&scheduler)
            .handler("double", |call: DurableCall<u64>| async move {
                Ok::<_, HandlerError>(call.payload * 2)
            })
            .build()
            .unwrap();
        ops.start("double", "a", &21_u64).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let result: OperationResult<u64> = ops.result("double", "a").unwrap();
        assert_eq!(result, OperationResult::Completed { result: 42 });
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_operation_retries_from_the_timer_and_the_alarm() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        h.install(&scheduler);
        let ops = Operations::builder(&scheduler)
            .handler("flaky", |call: DurableCall<()>| async move {
                if call.attempt < 4 {
                    Err(HandlerError::new("not yet"))
                } else {
                    Ok(call.attempt)
                }
            })
            .build()
            .unwrap();
        ops.start("flaky", "a", &()).await.unwrap();
        let result: OperationResult<u32> = ops
            .wait("flaky", "a", Duration::from_secs(600))
            .await
            .unwrap();
        assert_eq!(result, OperationResult::Completed { result: 4 });
    })
    .await;
}
