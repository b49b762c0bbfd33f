from tests.apps import build_app, client

async def test_smoke(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        r1 = await c.post("/accounts/acc1/credits", json={"amount": 5}, headers={"idempotency-key": "k1"})
        r2 = await c.post("/accounts/acc1/credits", json={"amount": 5}, headers={"idempotency-key": "k1"})
        r3 = await c.post("/accounts/acc1/credits", json={"amount": 6}, headers={"idempotency-key": "k1"})
    print(r1.status_code, r1.headers, r1.text)
    print(r2.status_code, r2.headers, r2.text)
    print(r3.status_code, r3.headers, r3.text)
    assert r1.status_code == 201 and r2.status_code == 201 and r3.status_code == 422
